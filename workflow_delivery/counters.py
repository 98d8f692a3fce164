"""Counters of what this process did, kept in-process in the app's own registry.

They count the calls of ``services`` made by this process (a web worker serving the
agent API, a consumer, the reaper): a site running several processes scrapes each,
or runs prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``). The
figures that describe the table itself are read from the database at scrape time
(``metrics``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry(auto_describe=True)

CLAIMS = Counter(
    "workflow_delivery_claims", "Deliveries claimed by this process.", registry=REGISTRY
)
SETTLES = Counter(
    "workflow_delivery_settles",
    "Deliveries settled by their holder, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
LEASES_LOST = Counter(
    "workflow_delivery_leases_lost",
    "Renewals and settles that found their lease lost.",
    registry=REGISTRY,
)
REAPED = Counter(
    "workflow_delivery_reaped",
    "Expired leases taken by the reaper: reclaimed (back to pending) or "
    "attempts_exhausted (settled failed by WORKFLOW_DELIVERY_MAX_ATTEMPTS).",
    ["result"],
    registry=REGISTRY,
)
PRUNED = Counter(
    "workflow_delivery_pruned", "Terminal deliveries deleted by retention.", registry=REGISTRY
)
FENCE_REFUSALS = Counter(
    "workflow_delivery_fence_refusals",
    "Writes of this process refused by the community write fence.",
    registry=REGISTRY,
)

# Every label value from the start, so a rate() has a zero to begin from. The
# labelled children are kept: ``labels()`` costs a lock and a lookup per call.
SETTLED = {outcome: SETTLES.labels(outcome) for outcome in ("finished", "failed")}
for _result in ("reclaimed", "attempts_exhausted"):
    REAPED.labels(_result)
