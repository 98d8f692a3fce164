"""An operator's retry: failed deliveries, named or selected, back to pending."""

from __future__ import annotations

import getpass
import uuid
from argparse import ArgumentParser
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.dateparse import parse_datetime
from tqdm import tqdm

from workflow_delivery import services
from workflow_delivery.commandline import (
    add_database_options,
    community_option,
    databases_option,
    positive,
    stop_on_signals,
)
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import DeletionState, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus
from workflow_delivery.validation import parse_duration

# Deliveries retried per statement (one community at a time).
DEFAULT_BATCH_SIZE = 500
FAILED = DeliveryStatus.FAILED.value


def _uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise CommandError(f"delivery id: {value!r} is not a UUID") from None


def _target(value: str) -> bytes:
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise CommandError(f"--target: {value!r} is not 32 bytes as 64 hex digits")
    return key


def _instant(option: str, value: str) -> datetime | timedelta:
    """An ISO 8601 time with its offset, or a duration (``2h``: that long ago)."""
    try:
        return parse_duration(value)
    except ValueError:
        pass
    try:
        instant = parse_datetime(value)
    except ValueError:
        instant = None
    if instant is None or instant.tzinfo is None:
        raise CommandError(
            f"{option}: {value!r} is neither a duration (30d, 12h, 15m, 90s: that long ago) "
            "nor an ISO 8601 time with its offset (2026-01-31T09:00:00+00:00)"
        )
    return instant


def _finished(lookup: str, value: datetime | timedelta) -> Q:
    # A duration is taken back from the database clock, as every settle is stamped.
    bound = Now() - value if isinstance(value, timedelta) else value
    return Q(**{f"finished_at__{lookup}": bound})


class Command(BaseCommand):
    help = (
        "Retry failed deliveries: back to pending, claimable at once, with the fence bumped "
        "and the attempts budget renewed; the timeline records the operator and --reason. "
        "Name deliveries by id, or select the failed ones by --community, --target, --error, "
        "--failed-since and --failed-before (all given must match). A finished delivery is "
        "never reopened; a community that is not active is skipped. SIGTERM/SIGINT stop "
        "after the current batch."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("ids", nargs="*", metavar="delivery_id", help="deliveries, by id")
        parser.add_argument("--community", help="the community's id or host")
        parser.add_argument("--target", help="the target agent's key, 64 hex digits")
        parser.add_argument("--error", help="a part of the last error's type or message (any case)")
        parser.add_argument(
            "--failed-since",
            help="failed at or after: an ISO 8601 time with its offset, or a duration ago (12h)",
        )
        parser.add_argument(
            "--failed-before",
            help="failed before: an ISO 8601 time with its offset, or a duration ago (30m)",
        )
        parser.add_argument("--reason", help="why, for the delivery timeline (required)")
        parser.add_argument(
            "--operator",
            help="who retries, for the delivery timeline (operator:<name>; default: the "
            "system user running the command)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help=f"deliveries retried per statement (default: {DEFAULT_BATCH_SIZE})",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be retried, per community"
        )
        add_database_options(parser, sweeping=False)

    def handle(self, *args: Any, **options: Any) -> None:
        (alias,) = databases_option(options)
        batch_size = options["batch_size"]
        if batch_size is None:
            batch_size = DEFAULT_BATCH_SIZE
        positive("--batch-size", batch_size, whole=True)
        selection = self._selection(options, alias)
        rows = list(
            WorkflowAgentDelivery.objects.using(alias)
            .filter(selection)
            .order_by("community__host", "finished_at", "id")
            .values_list("community_id", "community__host", "community__deletion_state", "id")
        )
        by_community: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        hosts: dict[uuid.UUID, str] = {}
        inactive: Counter[str] = Counter()
        for community_id, host, state, delivery_id in rows:
            hosts[community_id] = host
            if state != DeletionState.ACTIVE:
                inactive[host] += 1
                continue
            by_community[community_id].append(delivery_id)
        self._report_named(options["ids"], rows, alias)
        for host, count in inactive.items():
            self.stderr.write(f"{host}: {count} failed deliveries skipped (community not active)")
        if options["dry_run"]:
            for community_id, ids in by_community.items():
                self.stdout.write(f"{hosts[community_id]}: would retry {len(ids)}")
            total = sum(len(ids) for ids in by_community.values())
            self.stdout.write(f"would retry {total} failed deliveries")
            return
        if not options["reason"] or not options["reason"].strip():
            raise CommandError("--reason is required: say why, for the delivery timeline")
        operator = options["operator"] or getpass.getuser()
        retried, considered, stopped = self._retry(
            by_community, batch_size, operator, options, alias
        )
        ending = f"stopped by {stopped}: " if stopped else ""
        skipped = considered - retried
        why = " (changed meanwhile, or the community stopped being active)" if skipped else ""
        self.stdout.write(f"{ending}{retried} retried, {skipped} skipped{why}")

    def _selection(self, options: dict[str, Any], alias: str) -> Q:
        ids = [_uuid(value) for value in options["ids"]]
        selection = Q(status=FAILED)
        if ids:
            selection &= Q(id__in=ids)
        if options["community"] is not None:
            community = community_option("--community", options["community"], alias)
            selection &= Q(community_id=community)
        if options["target"] is not None:
            selection &= Q(target_pubkey=_target(options["target"]))
        if options["error"] is not None:
            if not options["error"].strip():
                raise CommandError("--error: give a part of the error to match, not blanks")
            selection &= Q(last_error_message__icontains=options["error"]) | Q(
                last_error_type__icontains=options["error"]
            )
        for option, lookup in (("failed_since", "gte"), ("failed_before", "lt")):
            if options[option] is not None:
                flag = f"--{option.replace('_', '-')}"
                selection &= _finished(lookup, _instant(flag, options[option]))
        if selection == Q(status=FAILED):
            raise CommandError(
                "select the deliveries to retry: name them by id, or give --community, "
                "--target, --error, --failed-since or --failed-before"
            )
        return selection

    def _report_named(self, named: list[str], rows: list[tuple], alias: str) -> None:
        """Say which named deliveries are not retried, and why."""
        if not named:
            return
        selected = {row[3] for row in rows}
        missing = [i for i in map(_uuid, named) if i not in selected]
        found = dict(
            WorkflowAgentDelivery.objects.using(alias)
            .filter(id__in=missing)
            .values_list("id", "status")
        )
        for delivery_id in missing:
            status = found.get(delivery_id)
            why = "no such delivery" if status is None else f"it is {status}, not failed"
            if status == FAILED:
                why = "it does not match the other options"
            self.stderr.write(f"{delivery_id}: not retried ({why})")

    def _retry(
        self,
        by_community: dict[uuid.UUID, list[uuid.UUID]],
        batch_size: int,
        operator: str,
        options: dict[str, Any],
        alias: str,
    ) -> tuple[int, int, str | None]:
        retried = considered = 0
        total = sum(len(ids) for ids in by_community.values())
        with stop_on_signals() as stop:
            bar = tqdm(
                total=total,
                unit="delivery",
                desc="retrying",
                disable=options["verbosity"] < 1,
                file=self.stderr,
            )
            with bar:
                batches = [
                    (community_id, ids[start : start + batch_size])
                    for community_id, ids in by_community.items()
                    for start in range(0, len(ids), batch_size)
                ]
                for community_id, batch in batches:
                    if stop:
                        break
                    try:
                        done = services.retry_failed_deliveries(
                            community_id,
                            batch,
                            operator=operator,
                            reason=options["reason"],
                            using=alias,
                        )
                    except ProtocolError as exc:
                        raise CommandError(str(exc)) from exc
                    retried += len(done)
                    considered += len(batch)
                    bar.update(len(batch))
        return retried, considered, stop.signal_name if stop else None
