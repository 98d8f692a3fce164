"""Retention: delete terminal deliveries (and their timeline) settled before a cut-off."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from tqdm import tqdm

from workflow_delivery import services
from workflow_delivery.commandline import (
    add_database_options,
    databases_option,
    duration_option,
    log_level,
    positive,
    stop_on_signals,
)
from workflow_delivery.conf import app_settings


class Command(BaseCommand):
    help = (
        "Delete finished and failed deliveries settled more than --older-than ago, in every "
        "active community, in bounded batches. Pending and claimed deliveries are never "
        "deleted; communities that are not active, or whose deletion is in progress, are "
        "skipped. SIGTERM/SIGINT stop after the current batch."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--older-than",
            help="30d, 12h, 15m or 90s; 0s: every terminal row (default: "
            "WORKFLOW_DELIVERY_RETENTION)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help="rows deleted per batch (default: WORKFLOW_DELIVERY_PRUNE_BATCH_SIZE)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted, per community"
        )
        add_database_options(parser, sweeping=True)

    def handle(self, *args: Any, **options: Any) -> None:
        older_than = duration_option("--older-than", options["older_than"])
        batch_size = options["batch_size"]
        if batch_size is None:
            batch_size = app_settings.PRUNE_BATCH_SIZE
        positive("--batch-size", batch_size, whole=True)
        databases = databases_option(options)
        several = len(databases) > 1
        prunable = {}
        for alias in databases:
            for host, count in services.count_prunable(older_than, using=alias).items():
                prunable[f"{alias}: {host}" if several else host] = count
        if options["dry_run"]:
            for host, count in prunable.items():
                self.stdout.write(f"{host}: would prune {count}")
            self.stdout.write(f"would prune {sum(prunable.values())} terminal deliveries")
            return
        pruned = 0
        with log_level(options["verbosity"]), stop_on_signals() as stop:
            bar = tqdm(
                total=sum(prunable.values()),
                unit="row",
                desc="pruning",
                disable=options["verbosity"] < 1,
                file=self.stderr,
            )
            with bar:
                for alias in databases:
                    if stop:
                        break
                    pruned += services.prune_deliveries(
                        older_than=older_than,
                        batch_size=batch_size,
                        on_batch=lambda count, seconds: bar.update(count),
                        should_stop=lambda: bool(stop),
                        using=alias,
                    )
        ending = f"stopped by {stop.signal_name}: " if stop else ""
        self.stdout.write(f"{ending}pruned {pruned} terminal deliveries")
