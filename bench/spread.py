"""The spread of each figure over several ``bench/run.py --json`` files: one Markdown
row per figure with its ratio (or value, where it has no baseline) in every run, the
lowest and the highest, and how many runs met its bar. Where the bar is on the value
(a latency or a time, or a figure without baseline) the value is shown instead.

    .venv/bin/python bench/spread.py bench/results/run1.json bench/results/run2.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN.json")
    return parser.parse_args(argv)


def _load(path: Path) -> list[dict]:
    try:
        document = json.loads(path.read_text())
        figures = document["figures"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"spread: {path} is not a bench/run.py --json file ({exc})") from None
    return figures


def _shown(figure: dict) -> float | None:
    """What the figure's bar is about: its value for a bar from below (a latency, a
    time) or a figure without a baseline, else its ratio to the baseline."""
    if figure.get("bar_below") or figure.get("ratio") is None:
        return figure.get("value")
    return figure["ratio"]


def _bar(figure: dict) -> str:
    if figure.get("bar") is None:
        return "—"
    sign = "<" if figure.get("bar_below") else "≥"
    return f"{sign} {figure['bar']:g}"


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    runs = [_load(path) for path in args.runs]
    # Figures in the order of their first appearance; each run may hold a subset.
    order: dict[tuple[str, str], dict] = {}
    for figures in runs:
        for figure in figures:
            order.setdefault((figure["benchmark"], figure["name"]), figure)
    names = [path.stem for path in args.runs]
    print("| benchmark | figure | " + " | ".join(names) + " | low | high | bar | met |")
    print("|---|---|" + "---:|" * (len(names) + 2) + "---|---|")
    for key, first in order.items():
        found = [
            next((f for f in figures if (f["benchmark"], f["name"]) == key), None)
            for figures in runs
        ]
        values = [_shown(f) for f in found if f is not None and _shown(f) is not None]
        cells = ["—" if f is None or _shown(f) is None else f"{_shown(f):,.3g}" for f in found]
        judged = [f for f in found if f is not None and f.get("met") is not None]
        met = f"{sum(bool(f['met']) for f in judged)} of {len(judged)}" if judged else "—"
        low = f"{min(values):,.3g}" if values else "—"
        high = f"{max(values):,.3g}" if values else "—"
        print(
            f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {low} | {high} | "
            f"{_bar(first)} | {met} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
