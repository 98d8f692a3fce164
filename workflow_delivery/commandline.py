"""What the app's commands share: a polite stop on SIGTERM/SIGINT, logging tied to
--verbosity, and the checks of their options (a community by id or host among them).

Commands stay thin: they parse arguments, check them here, call a service or build a
``reaper.Reaper``, and report."""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from argparse import ArgumentParser
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType
from typing import Any

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.functions import Lower

from . import routing
from .conf import app_settings
from .models import Community
from .validation import is_key_hex, is_number, is_whole_number, parse_duration

# The reaper's logger: the commands report there too (docs/howto/operations.md), so one
# --verbosity and one logging setting govern both.
logger = logging.getLogger("workflow_delivery.reaper")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
VERBOSITY_LEVELS = {0: logging.WARNING, 1: logging.INFO}


class StopRequest:
    """Set by the first SIGTERM/SIGINT (or ``request``); a second signal exits at once."""

    def __init__(self) -> None:
        # A plain flag, not a threading.Event: a signal handler must take no lock.
        self._stopped = False
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self._stopped

    def request(self, name: str) -> None:
        self.signal_name = self.signal_name or name
        self._stopped = True

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early once a stop is requested."""
        deadline = time.monotonic() + seconds
        while not self._stopped and (remaining := deadline - time.monotonic()) > 0:
            time.sleep(min(remaining, 0.05))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._stopped:
            logger.warning("second %s: exiting at once", name)
            raise SystemExit(128 + signum)
        logger.info("%s received: finishing the current batch, then stopping", name)
        self.request(name)


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Catch SIGTERM/SIGINT for the duration of the block and restore the previous
    handlers after it. Outside the main thread signals cannot be caught; the block
    then only stops when ``request`` is called."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.signal(signum, stop._handle) for signum in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def log_level(verbosity: int) -> Iterator[None]:
    """Tie the reaper's logging to a command's --verbosity (2 and up: every batch)."""
    previous = logger.level
    logger.setLevel(VERBOSITY_LEVELS.get(verbosity, logging.DEBUG))
    try:
        yield
    finally:
        logger.setLevel(previous)


def positive(option: str, value: object, *, whole: bool) -> None:
    """Refuse a command option that is not positive. Checked in the command rather
    than by argparse, so ``call_command(..., interval=0)`` is refused too."""
    if not ((is_whole_number if whole else is_number)(value) and value > 0):
        noun = "whole number" if whole else "number of seconds"
        raise CommandError(f"{option} must be a positive {noun}, not {value!r}")


def key_option(option: str, value: object) -> bytes:
    """A public key option: 64 lowercase hex characters, as its 32 bytes."""
    if not is_key_hex(value):
        raise CommandError(f"{option} must be 64 lowercase hex characters, not {value!r}")
    return bytes.fromhex(value)


def add_database_options(parser: ArgumentParser, *, sweeping: bool) -> None:
    parser.add_argument(
        "--database", default=DEFAULT_DB_ALIAS, help="the database alias (default: default)"
    )
    if sweeping:
        parser.add_argument(
            "--all-databases",
            action="store_true",
            help="sweep every database alias that holds the app's tables, one after the other",
        )


def databases_option(options: dict[str, Any]) -> list[str]:
    """The aliases a command works on: ``--database``, or every alias holding the app's
    tables with ``--all-databases``."""
    alias = options["database"]
    if options.get("all_databases"):
        if alias != DEFAULT_DB_ALIAS:
            raise CommandError("--database and --all-databases exclude each other")
        return routing.app_databases()
    if alias not in connections:
        raise CommandError(f"--database: no database alias {alias!r} in DATABASES")
    return [alias]


def duration_option(option: str, value: object) -> timedelta:
    """A retention option (``30d``, ``12h``, ``15m``, ``90s``); None reads
    ``WORKFLOW_DELIVERY_RETENTION``."""
    if value is None:
        value = app_settings.RETENTION
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise CommandError(f"{option}: {exc}") from None


def community_option(option: str, value: str, using: str) -> uuid.UUID:
    """The id of the community ``value`` names, by id or by host (any case)."""
    communities = Community.objects.using(using)
    try:
        by_id = communities.filter(id=uuid.UUID(value))
    except ValueError:
        by_id = communities.none()
    found = by_id.values_list("id", flat=True).first()
    if found is None:
        found = (
            communities.annotate(lower_host=Lower("host"))
            .filter(lower_host=value.lower())
            .values_list("id", flat=True)
            .first()
        )
    if found is None:
        raise CommandError(f"{option}: no community has the id or host {value!r}")
    return found
