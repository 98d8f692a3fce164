"""A Prometheus exposition of the inbox: what the table holds, read at scrape time
through the partial indexes, and the in-process counters of ``counters``.

Mount it in the host's URLconf (``path("metrics", include("workflow_delivery.metrics"))``)
behind whatever guards the site's other internal endpoints: it names every community.

Per community (labelled by host and deletion state):

* ``workflow_delivery_deliveries{status}``: pending rows by an index-only scan of
  ``wd_delivery_claim_idx``, claimed rows through ``wd_delivery_reap_idx`` (few: one
  per live holder), terminal rows by an index-only scan of ``wd_delivery_settled_idx``
  (the heap is never read; the cost grows with the index of terminal rows, which
  retention bounds).
* ``workflow_delivery_oldest_pending_age_seconds``, by the database clock.
* ``workflow_delivery_expired_leases``: claimed rows whose lease has run out, in
  active communities only (the reaper never takes the others).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from .counters import REGISTRY
from .models import STATUSES, DeletionState
from .store import run, statements


@dataclass
class CommunityFigures:
    host: str
    state: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    oldest_pending_age: float | None = None
    expired_leases: int = 0


def community_figures(using: str = DEFAULT_DB_ALIAS) -> dict[object, CommunityFigures]:
    """Every community's figures, keyed by its id, from four index-served queries."""
    communities = run.fetch(using, statements.METRICS_COMMUNITIES)
    figures = {cid: CommunityFigures(host, state) for cid, host, state in communities}
    for cid, count, age in run.fetch(using, statements.METRICS_PENDING):
        if cid in figures:
            figures[cid].counts["pending"] = count
            figures[cid].oldest_pending_age = float(age)
    for cid, count, expired in run.fetch(using, statements.METRICS_CLAIMED):
        if cid in figures:
            figures[cid].counts["claimed"] = count
            if figures[cid].state == DeletionState.ACTIVE:
                figures[cid].expired_leases = expired
    for cid, status, count in run.fetch(using, statements.METRICS_TERMINAL):
        if cid in figures:
            figures[cid].counts[status] = count
    return figures


class DeliveryCollector:
    """Reads the figures from the database at each scrape."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using

    def describe(self) -> Iterable[Metric]:
        # Names only: registering the collector must not query the database.
        return list(self._families())

    def _families(self) -> Iterator[GaugeMetricFamily]:
        labels = ["community", "state"]
        yield GaugeMetricFamily(
            "workflow_delivery_deliveries",
            "Deliveries per community and status.",
            labels=[*labels, "status"],
        )
        yield GaugeMetricFamily(
            "workflow_delivery_oldest_pending_age_seconds",
            "Age of the community's oldest pending delivery (database clock).",
            labels=labels,
        )
        yield GaugeMetricFamily(
            "workflow_delivery_expired_leases",
            "Expired leases awaiting the reaper (active communities only).",
            labels=labels,
        )

    def collect(self) -> Iterator[Metric]:
        deliveries, oldest, expired = self._families()
        for figures in community_figures(self.using).values():
            labels = [figures.host, figures.state]
            for status, count in figures.counts.items():
                deliveries.add_metric([*labels, status], count)
            if figures.oldest_pending_age is not None:
                oldest.add_metric(labels, figures.oldest_pending_age)
            if figures.state == DeletionState.ACTIVE:
                expired.add_metric(labels, figures.expired_leases)
        yield from (deliveries, oldest, expired)


_COLLECTORS: dict[str, DeliveryCollector] = {}


def exposition(using: str = DEFAULT_DB_ALIAS) -> bytes:
    """The text format: the table's figures for ``using`` and this process's counters."""
    if using not in _COLLECTORS:
        _COLLECTORS[using] = DeliveryCollector(using)
        REGISTRY.register(_COLLECTORS[using])
    return generate_latest(REGISTRY)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)


urlpatterns = [path("", metrics_view, name="workflow_delivery_metrics")]
