"""Append-only JSON-lines journals: what each chaos process did, in its own file.

A line is written with one ``write`` on an ``O_APPEND`` descriptor, so it is in the kernel once
the call returns and survives a ``kill -9`` of its writer. A torn last line (a writer killed
inside ``write``) is skipped when reading.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple


class Journal:
    def __init__(self, path: Path, **stamp: Any) -> None:
        self.path = path
        self._stamp = stamp
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, op: str, **fields: Any) -> None:
        line = {"t": time.time(), "op": op, **self._stamp, **fields}
        os.write(self._fd, (json.dumps(line, default=str) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as lines:
        for line in lines:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_all(directory: Path) -> list[dict[str, Any]]:
    """Every line of every journal in ``directory``, in time order."""
    records = [line for path in sorted(directory.glob("*.jsonl")) for line in read_lines(path)]
    records.sort(key=lambda line: line["t"])
    return records


class Held(NamedTuple):
    """What an agent's journal says it holds: the lease, and when its work should end."""

    delivery_id: str
    generation: int
    # Wall-clock time the holder's work is planned to end (its claim line's ``t`` plus
    # ``work``), None for a journal that does not say.
    busy_until: float | None


def last_holding(path: Path) -> Held | None:
    """The lease an agent's journal says it holds right now, if any."""
    held = None
    for line in read_lines(path):
        if line["op"] == "claim":
            work = line.get("work")
            busy_until = None if work is None else line["t"] + work
            held = Held(line["id"], line["gen"], busy_until)
        elif line["op"] in ("finish", "abandon") or (
            line["op"] == "renew" and line["result"] != "renewed"
        ):
            held = None
    return held
