"""The sweeps run by the reaper, the prune command and the admin's reap action:
expired leases back to pending (or failed at the attempt cap), and settled deliveries
deleted after their retention, each in bounded batches that rest between them."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from .. import counters
from ..conf import app_settings
from ..exceptions import ProtocolError
from ..protocol import Reaped
from ..store import run, statements
from ..validation import checked_batch_size, checked_yield_ratio, parse_duration
from ._common import max_attempts


def _batches(
    run_batch: Callable[[], int],
    size: int,
    ratio: float,
    on_batch: Callable[[int, float], None] | None,
    should_stop: Callable[[], bool] | None,
) -> None:
    """Run bounded batches until one comes back short or ``should_stop()``; after a
    full batch, rest ``ratio`` times as long as it took."""
    while True:
        started = time.monotonic()
        count = run_batch()
        elapsed = time.monotonic() - started
        if on_batch is not None:
            on_batch(count, elapsed)
        if count < size or (should_stop is not None and should_stop()):
            return
        if ratio:
            time.sleep(elapsed * ratio)


def reap_deliveries(
    *,
    batch_size: int | None = None,
    yield_ratio: float | None = None,
    on_batch: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_locked: Callable[[list[UUID]], None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Reaped:
    """Return every expired lease of every active community to pending, bumping its
    fence, in bounded batches until none is left. A delivery that has used
    ``WORKFLOW_DELIVERY_MAX_ATTEMPTS`` claims is settled ``failed`` instead.

    After a full batch the sweep rests ``yield_ratio`` times as long as that batch
    took (default ``WORKFLOW_DELIVERY_REAP_YIELD_RATIO``), so a large backlog leaves
    the database to live holders part of the time; 0 sweeps flat out.
    ``on_batch(count, seconds)`` observes each batch; ``should_stop()`` ends the sweep
    between batches.

    The sweep never waits on a tenant: a community whose deletion lock is held or
    queued for (a transition or purge in progress) is skipped for this batch, and
    ``on_locked(ids)`` is told which were skipped (only when some were)."""
    size = checked_batch_size(batch_size, app_settings.REAP_BATCH_SIZE)
    ratio = checked_yield_ratio(yield_ratio, app_settings.REAP_YIELD_RATIO)
    cap = max_attempts()
    reclaimed = exhausted = 0

    def batch() -> int:
        nonlocal reclaimed, exhausted
        # Each batch is its own short transaction (unless the caller holds one), so a
        # sweep never holds more than ``size`` row locks at once. The statement writes
        # its own timeline entries and leaves no setting behind.
        ((count, failed, locked),) = run.fetch(using, statements.reap_batch(size, cap))
        if locked and on_locked is not None:
            on_locked(list(locked))
        reclaimed += count - failed
        exhausted += failed
        return count

    _batches(batch, size, ratio, on_batch, should_stop)
    counters.REAPED.labels("reclaimed").inc(reclaimed)
    counters.REAPED.labels("attempts_exhausted").inc(exhausted)
    return Reaped(reclaimed=reclaimed, exhausted=exhausted)


def reap_expired_deliveries(
    *,
    batch_size: int | None = None,
    yield_ratio: float | None = None,
    on_batch: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_locked: Callable[[list[UUID]], None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """``reap_deliveries`` reporting only how many expired leases it took (returned
    to pending or settled failed by the attempt cap)."""
    return reap_deliveries(
        batch_size=batch_size,
        yield_ratio=yield_ratio,
        on_batch=on_batch,
        should_stop=should_stop,
        on_locked=on_locked,
        using=using,
    ).total


def prune_deliveries(
    *,
    older_than: timedelta | str | None = None,
    batch_size: int | None = None,
    yield_ratio: float | None = None,
    on_batch: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Delete terminal deliveries (their timeline with them) settled more than
    ``older_than`` ago (default ``WORKFLOW_DELIVERY_RETENTION``) in every active
    community, in bounded batches; returns how many. After a full batch it rests
    ``yield_ratio`` times as long as the batch took (default
    ``WORKFLOW_DELIVERY_PRUNE_YIELD_RATIO``). A community that is not active, or whose
    deletion lock is taken, is skipped inside the statement. Pending and claimed rows
    are never touched, whatever their age."""
    cutoff = prune_cutoff(older_than, using=using)
    size = checked_batch_size(batch_size, app_settings.PRUNE_BATCH_SIZE)
    ratio = checked_yield_ratio(yield_ratio, app_settings.PRUNE_YIELD_RATIO)
    total = 0

    def batch() -> int:
        nonlocal total
        # One short transaction per batch: the try-locks on the communities and the
        # row locks end with it.
        count = len(run.fetch(using, statements.PRUNE_BATCH, {"cutoff": cutoff, "limit": size}))
        total += count
        return count

    _batches(batch, size, ratio, on_batch, should_stop)
    counters.PRUNED.inc(total)
    return total


def prune_cutoff(older_than: timedelta | str | None = None, *, using: str = DEFAULT_DB_ALIAS):
    """The instant before which terminal rows are pruned, by the database clock."""
    retention = app_settings.RETENTION if older_than is None else older_than
    try:
        age = parse_duration(retention)
    except ValueError as exc:
        raise ProtocolError("older_than", str(exc)) from None
    return run.fetch(using, statements.PRUNE_CUTOFF, {"age": age})[0][0]


def count_prunable(
    older_than: timedelta | str | None = None, *, using: str = DEFAULT_DB_ALIAS
) -> dict[str, int]:
    """What ``prune_deliveries`` would delete now, by community host (active ones)."""
    cutoff = prune_cutoff(older_than, using=using)
    counts = run.fetch(using, statements.PRUNE_COUNT, {"cutoff": cutoff})
    return {host: count for _, host, count in counts}
