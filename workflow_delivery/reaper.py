"""The reaper: sweeps expired leases back to pending (and, if asked, prunes terminal
deliveries), once or in a loop that survives a database going away (it logs, backs
off and reconnects) and stops between batches when asked to."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import DEFAULT_DB_ALIAS, close_old_connections, connections
from django.db.models import Count, F

from . import services
from .commandline import StopRequest
from .conf import app_settings
from .errors import is_connection_lost
from .exceptions import DeliveryTimeout
from .models import WorkflowAgentDelivery

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one pass of the reaper did (or, dry, would do)."""

    number: int
    reclaimed: int
    skipped_inactive: int
    batches: int
    seconds: float
    dry_run: bool = False
    by_community: dict[str, int] = field(default_factory=dict)
    # Active tenants skipped because their deletion lock was taken (a transition or
    # purge in progress): the sweep does not wait for them, the next one retries.
    skipped_locked: int = 0
    exhausted: int = 0
    pruned: int | None = None

    def log_line(self) -> str:
        parts = {
            "sweep": self.number,
            "would_reclaim" if self.dry_run else "reclaimed": self.reclaimed,
            "skipped_inactive": self.skipped_inactive,
            "batches": self.batches,
            "seconds": f"{self.seconds:.3f}",
            "skipped_locked": self.skipped_locked,
            "would_fail_exhausted" if self.dry_run else "failed_exhausted": self.exhausted,
        }
        if self.pruned is not None:
            parts["would_prune" if self.dry_run else "pruned"] = self.pruned
        return " ".join(f"{key}={value}" for key, value in parts.items())


@dataclass(frozen=True, slots=True)
class LoopSummary:
    sweeps: int
    failed: int
    reclaimed: int
    stopped_by: str | None
    exhausted: int = 0
    pruned: int = 0

    def __str__(self) -> str:
        ending = f"stopped by {self.stopped_by}" if self.stopped_by else "done"
        return (
            f"{ending}: {self.sweeps} sweeps ({self.failed} failed), "
            f"reclaimed {self.reclaimed} expired leases; failed {self.exhausted} that had "
            f"used every attempt; pruned {self.pruned} terminal deliveries"
        )


class Reaper:
    """Sweeps expired leases back to pending: once, or in a loop until stopped."""

    def __init__(
        self,
        *,
        batch_size: int,
        dry_run: bool = False,
        using: str = DEFAULT_DB_ALIAS,
        max_backoff: float = 5.0,
        prune_older_than: timedelta | None = None,
        prune_batch_size: int | None = None,
        databases: list[str] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.dry_run = dry_run
        self.using = using
        # Every alias a sweep visits, one after the other (--all-databases).
        self.databases = databases or [using]
        self.max_backoff = max_backoff
        # Retention as part of each sweep (off unless asked for).
        self.prune_older_than = prune_older_than
        self.prune_batch_size = prune_batch_size

    def _expired(self, using: str):
        return WorkflowAgentDelivery.objects.using(using).expired_leases()

    def sweep(self, number: int = 1, stop: StopRequest | None = None) -> Sweep:
        """One pass over every database of the reaper (one by default)."""
        if len(self.databases) == 1:
            return self._sweep_one(number, stop, self.databases[0])
        passes = []
        for alias in self.databases:
            if stop:
                break
            passes.append(self._sweep_one(number, stop, alias))
        return Sweep(
            number=number,
            reclaimed=sum(p.reclaimed for p in passes),
            skipped_inactive=sum(p.skipped_inactive for p in passes),
            batches=sum(p.batches for p in passes),
            seconds=sum(p.seconds for p in passes),
            dry_run=self.dry_run,
            by_community={
                f"{alias}: {host}": count
                for alias, p in zip(self.databases, passes, strict=False)
                for host, count in p.by_community.items()
            },
            skipped_locked=sum(p.skipped_locked for p in passes),
            exhausted=sum(p.exhausted for p in passes),
            pruned=None if self.prune_older_than is None else sum(p.pruned or 0 for p in passes),
        )

    def _sweep_one(self, number: int, stop: StopRequest | None, using: str) -> Sweep:
        started = time.monotonic()
        should_stop = (lambda: bool(stop)) if stop is not None else None
        pruned = None
        if self.dry_run:
            expired = self._expired(using).in_active_communities()
            cap = app_settings.MAX_ATTEMPTS
            exhausted = (
                0
                if cap is None
                else expired.filter(attempts__gte=F("attempts_at_retry") + cap).count()
            )
            rows = (
                expired.values_list("community__host")
                .annotate(count=Count("id"))
                .order_by("community__host")
            )
            by_community = dict(rows)
            reclaimed, batches = sum(by_community.values()) - exhausted, 0
            if self.prune_older_than is not None:
                prunable = services.count_prunable(self.prune_older_than, using=using)
                pruned = sum(prunable.values())
        else:
            by_community = {}
            batch_counts: list[int] = []
            locked: set = set()
            reaped = services.reap_deliveries(
                batch_size=self.batch_size,
                on_batch=lambda count, seconds: self._on_batch(batch_counts, count, seconds),
                should_stop=should_stop,
                on_locked=locked.update,
                using=using,
            )
            reclaimed, exhausted = reaped.reclaimed, reaped.exhausted
            for community_id in sorted(locked, key=str):
                logger.info("skipped community=%s reason=deletion_lock_taken", community_id)
            batches = len(batch_counts)
            if self.prune_older_than is not None and not stop:
                pruned = services.prune_deliveries(
                    older_than=self.prune_older_than,
                    batch_size=self.prune_batch_size,
                    should_stop=should_stop,
                    using=using,
                )
        skipped = self._expired(using).in_fenced_communities().count()
        return Sweep(
            number=number,
            reclaimed=reclaimed,
            skipped_inactive=skipped,
            batches=batches,
            seconds=time.monotonic() - started,
            dry_run=self.dry_run,
            by_community=by_community,
            skipped_locked=0 if self.dry_run else len(locked),
            exhausted=exhausted,
            pruned=pruned,
        )

    @staticmethod
    def _on_batch(counts: list[int], count: int, seconds: float) -> None:
        counts.append(count)
        logger.debug("batch=%s reclaimed=%s seconds=%.3f", len(counts), count, seconds)

    def loop(
        self,
        *,
        interval: float,
        stop: StopRequest,
        max_sweeps: int | None = None,
    ) -> LoopSummary:
        """Sweep every ``interval`` seconds until ``stop`` is set or ``max_sweeps``
        passes (failed ones included, so a bounded run ends even on a dead database)."""
        number = failed = reclaimed = exhausted = pruned = 0
        backoff = 0.0
        while not stop and (max_sweeps is None or number < max_sweeps):
            number += 1
            # Drop a connection that is broken or past CONN_MAX_AGE before each pass,
            # as Django does around a request.
            close_old_connections()
            try:
                result = self.sweep(number, stop)
            except DeliveryTimeout as exc:
                # A lock_timeout or statement_timeout cancelled a batch; the session is
                # fine and the next pass retries on it.
                failed += 1
                logger.warning("sweep=%s error=timeout sqlstate=%s", number, exc.sqlstate)
                pause = interval
            except Exception as exc:
                # Only a lost session (errors.is_connection_lost: class 08, 57P01-57P05,
                # 25P03-25P04, or a connection left closed) is retried on a fresh
                # connection; anything else is a bug.
                if not any(is_connection_lost(exc, connections[alias]) for alias in self.databases):
                    raise
                failed += 1
                backoff = min(self.max_backoff, backoff * 2 or 0.5)
                logger.exception(
                    "sweep=%s error=database_unavailable retry_in=%.1f", number, backoff
                )
                self._discard_connection()
                pause = backoff
            else:
                backoff = 0.0
                reclaimed += result.reclaimed
                exhausted += result.exhausted
                pruned += result.pruned or 0
                logger.info("%s", result.log_line())
                pause = interval
            if not stop and (max_sweeps is None or number < max_sweeps):
                stop.sleep(pause)
        return LoopSummary(number, failed, reclaimed, stop.signal_name, exhausted, pruned)

    def _discard_connection(self) -> None:
        # The next pass reconnects; closing a dead connection may itself fail.
        for alias in self.databases:
            try:
                connections[alias].close()
            except Exception as exc:
                if not is_connection_lost(exc):
                    raise
                logger.debug("closing the broken connection failed", exc_info=True)
