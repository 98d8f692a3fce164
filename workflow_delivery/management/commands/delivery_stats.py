"""Per community: deliveries by status, the oldest pending age, expired leases not yet reaped."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.contrib.postgres.functions import TransactionNow
from django.core.management.base import BaseCommand
from django.db import DEFAULT_DB_ALIAS
from django.db.models import Count, Min, Q

from workflow_delivery.commandline import add_database_options, databases_option
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus

STATUSES = [status.value for status in DeliveryStatus]


def collect(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """One grouped query; ages are measured by the database clock."""
    expired = WorkflowAgentDelivery.objects.using(using).expired_leases().values("id")
    counts = {
        status: Count("deliveries", filter=Q(deliveries__status=status)) for status in STATUSES
    }
    rows = (
        Community.objects.using(using)
        .annotate(
            **counts,
            oldest_pending=Min("deliveries__created_at", filter=Q(deliveries__status="pending")),
            expired_leases=Count("deliveries", filter=Q(deliveries__in=expired)),
            now=TransactionNow(),
        )
        .order_by("host")
    )
    communities = []
    for row in rows:
        oldest = row.oldest_pending
        communities.append(
            {
                "id": str(row.id),
                "host": row.host,
                "state": row.deletion_state,
                "counts": {status: getattr(row, status) for status in STATUSES},
                "oldest_pending_seconds": (
                    round((row.now - oldest).total_seconds(), 3) if oldest else None
                ),
                "expired_leases": row.expired_leases,
            }
        )
    totals = {status: sum(c["counts"][status] for c in communities) for status in STATUSES}
    return {
        "communities": communities,
        "totals": {**totals, "expired_leases": sum(c["expired_leases"] for c in communities)},
    }


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Command(BaseCommand):
    help = (
        "Deliveries per community and status, the age of the oldest pending one, and "
        "leases that have expired but are not reaped yet."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")
        add_database_options(parser, sweeping=False)

    def handle(self, *args: Any, **options: Any) -> None:
        (alias,) = databases_option(options)
        stats = collect(alias)
        if options["json"]:
            self.stdout.write(json.dumps(stats, indent=2))
            return
        header = ["community", "state", *STATUSES, "oldest pending", "expired leases"]
        lines = [header]
        for community in stats["communities"]:
            lines.append(
                [
                    community["host"],
                    community["state"],
                    *(str(community["counts"][status]) for status in STATUSES),
                    _age(community["oldest_pending_seconds"]),
                    str(community["expired_leases"]),
                ]
            )
        totals = stats["totals"]
        lines.append(
            ["total", "", *(str(totals[s]) for s in STATUSES), "", str(totals["expired_leases"])]
        )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        for line in lines:
            cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
            cells += [cell.rjust(width) for cell, width in zip(line[2:], widths[2:], strict=True)]
            self.stdout.write("  ".join(cells).rstrip())
