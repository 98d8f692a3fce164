"""Run a consumer in the foreground until SIGTERM/SIGINT or --max-deliveries."""

from __future__ import annotations

import logging
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from django.utils.module_loading import import_string

from workflow_delivery import consumer as consumer_module
from workflow_delivery.commandline import (
    VERBOSITY_LEVELS,
    community_option,
    key_option,
    positive,
    stop_on_signals,
)
from workflow_delivery.consumer import Consumer, ConsumerStats
from workflow_delivery.exceptions import ProtocolError

# How often --all-enrolled reads the roster again, in seconds.
DEFAULT_ROSTER_INTERVAL = 5.0


class Command(BaseCommand):
    help = (
        "Claim and handle the deliveries of one or more targets in a community (or, with "
        "--all-enrolled, of every enabled agent of its roster, followed as it changes): the "
        "handler (a dotted path to a callable taking record, lease, context) runs under "
        "a heartbeat; returning settles finished, raising gives the delivery back to be "
        "retried after a backoff (until WORKFLOW_DELIVERY_MAX_ATTEMPTS, then failed), "
        "raising workflow_delivery.consumer.PermanentFailure settles failed. Stops on "
        "SIGTERM or SIGINT (in-flight handlers get a grace period, then their leases "
        "are released; a second signal exits at once)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--community", required=True, help="the community's id or host")
        parser.add_argument(
            "--target",
            action="append",
            help="target public key, 64 lowercase hex (repeat for several)",
        )
        parser.add_argument(
            "--all-enrolled",
            action="store_true",
            help="serve every enabled agent of the community's roster, following "
            "enrollments and revocations (instead of --target)",
        )
        parser.add_argument(
            "--roster-interval",
            type=float,
            default=DEFAULT_ROSTER_INTERVAL,
            help="with --all-enrolled, seconds between reads of the roster (default %(default)s)",
        )
        parser.add_argument("--handler", required=True, help="dotted path of the handler")
        parser.add_argument(
            "--lease-seconds",
            type=int,
            default=consumer_module.DEFAULT_LEASE_SECONDS,
            help="lease length; renewed every third of it (default %(default)s)",
        )
        parser.add_argument(
            "--concurrency", type=int, default=1, help="deliveries in flight at most"
        )
        parser.add_argument(
            "--max-deliveries", type=int, help="stop after handling this many deliveries"
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=consumer_module.DEFAULT_POLL_INTERVAL,
            help="seconds between polls when no wake-up arrives (default %(default)s)",
        )
        parser.add_argument(
            "--grace-seconds",
            type=float,
            default=consumer_module.DEFAULT_GRACE_SECONDS,
            help="on stop, how long in-flight handlers may still finish (default %(default)s)",
        )
        parser.add_argument("--database", default="default", help="database alias")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["database"] not in connections:
            raise CommandError(f"--database {options['database']!r} is not a configured alias")
        community_id = community_option("--community", options["community"], options["database"])
        if options["all_enrolled"] == bool(options["target"]):
            raise CommandError("name the targets with --target, or serve --all-enrolled (one)")
        positive("--roster-interval", options["roster_interval"], whole=False)
        targets = [key_option("--target", value) for value in options["target"] or ()]
        try:
            handler = import_string(options["handler"])
        except ImportError as exc:
            raise CommandError(
                f"--handler {options['handler']!r} cannot be imported: {exc}"
            ) from exc
        if not callable(handler):
            raise CommandError(f"--handler {options['handler']!r} is not callable")
        positive("--lease-seconds", options["lease_seconds"], whole=True)
        positive("--concurrency", options["concurrency"], whole=True)
        positive("--poll-interval", options["poll_interval"], whole=False)
        if options["max_deliveries"] is not None:
            positive("--max-deliveries", options["max_deliveries"], whole=True)
        if options["grace_seconds"] < 0:
            raise CommandError(f"--grace-seconds must be >= 0, not {options['grace_seconds']}")
        self._last_line = ""
        self._tty = hasattr(self.stdout, "isatty") and self.stdout.isatty()
        try:
            consumer = Consumer(
                community_id,
                targets,
                handler,
                lease_seconds=options["lease_seconds"],
                concurrency=options["concurrency"],
                poll_interval=options["poll_interval"],
                max_deliveries=options["max_deliveries"],
                grace_seconds=options["grace_seconds"],
                using=options["database"],
                on_progress=self._progress if options["verbosity"] >= 1 else None,
                roster_interval=options["roster_interval"] if options["all_enrolled"] else None,
            )
        except ProtocolError as exc:
            raise CommandError(str(exc)) from exc
        logger = logging.getLogger(consumer_module.__name__)
        previous = logger.level
        logger.setLevel(VERBOSITY_LEVELS.get(options["verbosity"], logging.DEBUG))
        try:
            with stop_on_signals() as stop:
                stats = consumer.run(stop=lambda: bool(stop))
        finally:
            logger.setLevel(previous)
        if self._tty:
            self.stdout.write("")
        ending = f"stopped by {stop.signal_name}" if stop.signal_name else "done"
        self.stdout.write(f"{ending}: {stats.line()}")

    def _progress(self, stats: ConsumerStats) -> None:
        line = f"in progress: {stats.line()}"
        if line == self._last_line:
            return
        self._last_line = line
        if self._tty:
            # One line rewritten in place on a terminal; whole lines into a log.
            sys.stdout.write("\r" + line)
            sys.stdout.flush()
        else:
            self.stdout.write(line)
