"""Return expired leases to pending: one sweep, or a loop until SIGTERM/SIGINT."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflow_delivery.commandline import (
    add_database_options,
    databases_option,
    duration_option,
    log_level,
    positive,
    stop_on_signals,
)
from workflow_delivery.conf import app_settings
from workflow_delivery.reaper import Reaper, Sweep


class Command(BaseCommand):
    help = (
        "Return expired leases of active communities to pending, bumping their fence. "
        "One sweep by default; --loop sweeps every --interval seconds until SIGTERM or "
        "SIGINT (the current batch finishes; a second signal exits at once)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--loop", action="store_true", help="keep sweeping until stopped")
        parser.add_argument(
            "--interval",
            type=float,
            help="seconds between sweeps (default: WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help="rows reclaimed per batch (default: WORKFLOW_DELIVERY_REAP_BATCH_SIZE)",
        )
        parser.add_argument(
            "--max-sweeps",
            type=int,
            help="end the loop after this many sweeps, failed ones included",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="count what would be reclaimed, per community, without writing",
        )
        add_database_options(parser, sweeping=True)
        parser.add_argument(
            "--prune",
            action="store_true",
            help="also delete terminal deliveries older than --older-than after each sweep",
        )
        parser.add_argument(
            "--older-than",
            help="retention for --prune: 30d, 12h, 15m, 90s (default: WORKFLOW_DELIVERY_RETENTION)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        loop = options["loop"]
        for name in ("interval", "max_sweeps"):
            if options[name] is not None and not loop:
                raise CommandError(f"--{name.replace('_', '-')} applies only with --loop")
        interval = options["interval"]
        if interval is None:
            interval = app_settings.REAP_INTERVAL_SECONDS
        batch_size = options["batch_size"]
        if batch_size is None:
            batch_size = app_settings.REAP_BATCH_SIZE
        positive("--interval", interval, whole=False)
        positive("--batch-size", batch_size, whole=True)
        if options["max_sweeps"] is not None:
            positive("--max-sweeps", options["max_sweeps"], whole=True)
        if options["older_than"] is not None and not options["prune"]:
            raise CommandError("--older-than applies only with --prune")
        retention = None
        if options["prune"]:
            retention = duration_option("--older-than", options["older_than"])
        reaper = Reaper(
            batch_size=batch_size,
            dry_run=options["dry_run"],
            prune_older_than=retention,
            databases=databases_option(options),
        )
        with log_level(options["verbosity"]):
            if loop:
                self._loop(reaper, interval, options["max_sweeps"])
            else:
                self._report(reaper.sweep())

    def _report(self, sweep: Sweep) -> None:
        verb = "would reclaim" if sweep.dry_run else "reclaimed"
        for host, count in sweep.by_community.items():
            self.stdout.write(f"{host}: {verb} {count}")
        if sweep.pruned is not None:
            pruned = "would prune" if sweep.dry_run else "pruned"
            self.stdout.write(f"{pruned} {sweep.pruned} terminal deliveries")
        failed = "would settle failed" if sweep.dry_run else "settled failed"
        self.stdout.write(
            f"{failed} {sweep.exhausted} expired leases of deliveries that had used every "
            f"attempt (WORKFLOW_DELIVERY_MAX_ATTEMPTS={app_settings.MAX_ATTEMPTS})"
        )
        self.stdout.write(
            f"{verb} {sweep.reclaimed} expired leases; skipped {sweep.skipped_inactive} "
            f"in communities that are not active; skipped {sweep.skipped_locked} "
            f"communities whose deletion lock was taken; {sweep.seconds:.3f} s"
        )

    def _loop(self, reaper: Reaper, interval: float, max_sweeps: int | None) -> None:
        with stop_on_signals() as stop:
            summary = reaper.loop(interval=interval, stop=stop, max_sweeps=max_sweeps)
        self.stdout.write(str(summary))
