"""Every state change of a delivery: identity lock + commit, claim, renew, finish,
retry, reap.

Functions own their transaction (or join the caller's), take the database clock
for every time, and return frozen values from ``protocol``. Expected outcomes (a
miss, a lost lease) are values; database rule violations become named exceptions.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, DatabaseError, transaction

from . import counters, db, sql
from .conf import (
    LEASE_SECONDS_BOUND,
    app_settings,
    is_delay_seconds,
    is_whole_number,
    is_yield_ratio,
    parse_duration,
)
from .exceptions import (
    BindingScopeError,
    CommunityWriteFenced,
    InvalidLeaseSeconds,
    LeaseLostError,
    ProtocolError,
    StepIdentityClosed,
    WorkflowDeliveryConfigurationError,
)
from .models import WorkflowAgentDelivery
from .protocol import (
    AgentStanding,
    AlreadyTerminal,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    Exhausted,
    Lease,
    LeaseLost,
    MessageEvent,
    NewDelivery,
    Outcome,
    Reaped,
    Renewed,
    RequestAdmission,
    Retried,
    Settled,
    as_bytes32,
    as_datetime,
    as_step_id,
    as_uuid,
    error_report,
    stored_lease,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_BATCH_SIZE",
    "Held",
    "StepIdentity",
    "admit_request_event",
    "claim_deliveries",
    "claim_delivery",
    "commit_deliveries",
    "count_prunable",
    "delivery_identity",
    "fail_deliveries",
    "finish_deliveries",
    "finish_delivery",
    "get_delivery",
    "holding",
    "message_events",
    "prune_cutoff",
    "prune_deliveries",
    "prune_replay_guard",
    "reap_deliveries",
    "reap_expired_deliveries",
    "record_request_event",
    "register_idle",
    "release_deliveries",
    "release_lease",
    "renew_delivery",
    "retry_delivery",
    "send_message",
]


# The most leases one claim_deliveries or finish_deliveries call handles: a bound on
# the row locks one statement takes and on the size of its array parameters.
MAX_BATCH_SIZE = 1000


def _lease_seconds(value: object) -> int:
    # Bounded whatever the setting says (the system check reports a larger one), so a
    # lease end can never overflow the database's timestamp range.
    maximum = min(app_settings.MAX_LEASE_SECONDS, LEASE_SECONDS_BOUND)
    if value is None:
        value = app_settings.DEFAULT_LEASE_SECONDS
    if not is_whole_number(value):
        raise InvalidLeaseSeconds("lease_seconds", f"must be a whole number, not {value!r}")
    if not 0 < value <= maximum:
        raise InvalidLeaseSeconds("lease_seconds", f"must be between 1 and {maximum}, not {value}")
    return value


def _lease_params(lease: object) -> list[object]:
    if not isinstance(lease, Lease):
        raise ProtocolError("lease", f"must be a Lease, not {type(lease).__name__}")
    return [lease.community_id, lease.delivery_id, lease.target_pubkey, lease.generation]


def _new_deliveries(deliveries: object) -> list[NewDelivery]:
    if isinstance(deliveries, NewDelivery | str | bytes) or not isinstance(deliveries, Iterable):
        raise ProtocolError("deliveries", "must be a list of NewDelivery")
    batch = list(deliveries)
    if not batch:
        raise ProtocolError("deliveries", "a step commits at least one delivery")
    for item in batch:
        if not isinstance(item, NewDelivery):
            raise ProtocolError("deliveries", f"must hold NewDelivery, not {type(item).__name__}")
    return batch


def _insert_deliveries(
    insert: str, params: list[object], using: str, *, savepoint: bool = True
) -> list[UUID]:
    """Run a delivery insert (rows: id, community_id, target_pubkey) and return the
    created ids. With ``WORKFLOW_DELIVERY_NOTIFY`` on (the default) it wakes the
    consumers registered idle on the created rows' targets (``register_idle``), one
    notification per target, and consumes their registrations; targets nobody waits
    on cost one probe of the small idle registry and send nothing.

    By default (``WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION``) the insert itself does it
    (``sql.notifying``), so the wake-ups are part of the commit. Turned off, they go
    out right after the transaction commits, in a statement of their own
    (``on_commit``; a rollback drops them), and a producer that dies in between sends
    none."""
    in_statement = app_settings.NOTIFY and app_settings.NOTIFY_IN_TRANSACTION
    statement = sql.notifying(insert) if in_statement else insert
    rows = db.fetch(using, statement, params, savepoint=savepoint)
    if rows and app_settings.NOTIFY and not in_statement:
        created = [
            [row[0] for row in rows],
            [row[1] for row in rows],
            [bytes(row[2]) for row in rows],
        ]
        transaction.on_commit(partial(_wake_idle, created, using), using=using)
    return [row[0] for row in rows]


def _wake_idle(created: list[list[object]], using: str) -> None:
    # After the commit, in a transaction of its own that does not wait for its WAL
    # flush (see sql.WAKE_IDLE_AFTER_COMMIT). The deliveries are committed whatever
    # happens here; a wake-up lost to an error is what polling is for, so it is
    # logged, never raised to the producer.
    try:
        with db.cursor(using) as cursor:
            cursor.execute(sql.WAKE_IDLE_AFTER_COMMIT, created)
    except DatabaseError:
        logger.warning("wake-ups for %s deliveries were not sent", len(created[0]), exc_info=True)


def register_idle(
    community_id: UUID | str, targets: Iterable[bytes], *, using: str = DEFAULT_DB_ALIAS
) -> None:
    """Record that a consumer of ``targets`` found nothing to claim and is waiting for
    a wake-up: the next producer commit to one of them notifies (once) and consumes
    the registration. Call it only once the caller LISTENs, then poll once more
    before waiting: a delivery committed before the registration is found by that
    poll, one committed after it sends the wake. Commits on its own unless the
    caller's transaction is open."""
    community_id = as_uuid("community_id", community_id)
    if isinstance(targets, bytes | bytearray | str):
        raise ProtocolError("targets", "must be a list of 32-byte public keys")
    keys = sorted({as_bytes32("targets", target) for target in targets})
    if not keys:
        return
    with db.cursor(using) as cursor:
        cursor.execute(sql.REGISTER_IDLE, [community_id, keys])


class StepIdentity:
    """The producer's hold on one (community, run, step) inside its transaction."""

    def __init__(
        self, community_id: UUID, run_id: UUID, step_id: str, exists: bool, using: str
    ) -> None:
        self.community_id = community_id
        self.run_id = run_id
        self.step_id = step_id
        self.exists = exists
        self._using = using
        self._open = True

    def __repr__(self) -> str:
        return (
            f"StepIdentity(community_id={self.community_id}, run_id={self.run_id}, "
            f"step_id={self.step_id!r}, exists={self.exists})"
        )

    def _validate(self, batch: list[NewDelivery]) -> bool:
        """Check a step's batch; True when every delivery shares all of the first's
        binding but its target (the usual step)."""
        ids, targets = set(), set()
        first = batch[0].binding
        shared = True
        for item in batch:
            binding = item.binding
            if binding.community_id != self.community_id:
                raise BindingScopeError(
                    "community_id",
                    f"delivery {item.id} belongs to community {binding.community_id}, "
                    f"not the committing community {self.community_id}",
                )
            if binding.run_id != self.run_id or binding.step_id != self.step_id:
                raise BindingScopeError(
                    "step_id",
                    f"delivery {item.id} is for run {binding.run_id} step {binding.step_id!r}; "
                    f"this commit is for run {self.run_id} step {self.step_id!r} "
                    "(deliveries of several steps cannot share one commit)",
                )
            if binding.message_event_id != first.message_event_id:
                raise ProtocolError(
                    "message_event_id", "every delivery of a step carries the same message event"
                )
            if shared and (
                binding.workflow_id != first.workflow_id
                or binding.definition_event_id != first.definition_event_id
                or binding.cause != first.cause
            ):
                shared = False
            if item.id in ids:
                raise ProtocolError("id", f"delivery id {item.id} appears twice in one commit")
            if binding.target_pubkey in targets:
                raise ProtocolError(
                    "target_pubkey",
                    f"target {binding.target_pubkey.hex()} appears twice in one commit",
                )
            ids.add(item.id)
            targets.add(binding.target_pubkey)
        return shared

    def _values(
        self, message_event_created_at: datetime, batch: list[NewDelivery]
    ) -> tuple[bool, list[object]]:
        """The insert's parameters for a batch checked by ``_new_deliveries``, and
        whether they are for the shared form (``sql._SHARED_ROWS``: the first binding's
        shared columns, then the ids and the targets) or one list per column
        (``sql._INSERT_ROWS``, which unnests them into rows, in order)."""
        created_at = as_datetime("message_event_created_at", message_event_created_at)
        if self._validate(batch):
            b = batch[0].binding
            return True, [
                b.community_id,
                b.workflow_id,
                b.run_id,
                b.step_id,
                b.definition_event_id,
                b.message_event_id,
                created_at,
                *db.cause_columns(b),
                [item.id for item in batch],
                [item.binding.target_pubkey for item in batch],
            ]
        rows = []
        for item in batch:
            b = item.binding
            rows.append(
                [
                    item.id,
                    b.community_id,
                    b.workflow_id,
                    b.run_id,
                    b.step_id,
                    b.target_pubkey,
                    b.definition_event_id,
                    b.message_event_id,
                    created_at,
                    *db.cause_columns(b),
                ]
            )
        return False, [list(column) for column in zip(*rows, strict=True)]

    def commit(
        self, message_event_created_at: datetime, deliveries: Iterable[NewDelivery]
    ) -> list[UUID]:
        """Insert the step's deliveries at once; return the ids actually created.
        An existing (community, run, step, target) is skipped, so a retry creates nothing.
        A message other than the one the step's deliveries carry is refused
        (``StepMessageConflict``) and nothing is written."""
        if not self._open:
            # After the block the identity lock is released (and the transaction may
            # be autocommit): an insert now would skip the very check the lock gives.
            raise StepIdentityClosed(
                f"{self!r}: its delivery_identity block has closed; commit inside the block"
            )
        shared, params = self._values(message_event_created_at, _new_deliveries(deliveries))
        insert = sql.INSERT_SHARED_DELIVERIES if shared else sql.INSERT_DELIVERIES
        created = _insert_deliveries(
            insert, [self.community_id, *params], self._using, savepoint=False
        )
        if created:
            self.exists = True
        return created


@contextmanager
def delivery_identity(
    community_id: UUID | str,
    run_id: UUID | str,
    step_id: str,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> Iterator[StepIdentity]:
    """Open a transaction holding the step's identity lock. ``.exists`` tells whether
    the step already has deliveries (reuse the signed message); ``.commit`` inserts
    them. The producer's own writes in the block commit or roll back with them."""
    step_id = as_step_id(step_id)
    community_id = as_uuid("community_id", community_id)
    run_id = as_uuid("run_id", run_id)
    with transaction.atomic(using=using):
        with db.cursor(using, savepoint=False) as cursor:
            # Transaction-scoped: released by our commit or rollback, never leaked.
            cursor.execute(sql.LOCK_STEP_IDENTITY, [str(community_id), str(run_id), step_id])
            cursor.execute(sql.STEP_EXISTS, [community_id, run_id, step_id])
            exists = bool(cursor.fetchone()[0])
        identity = StepIdentity(community_id, run_id, step_id, exists, using)
        try:
            yield identity
        finally:
            identity._open = False


def commit_deliveries(
    community_id: UUID | str,
    message_event_created_at: datetime,
    deliveries: Iterable[NewDelivery],
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Commit the deliveries of one (run, step) in one call; returns the ids created."""
    batch = _new_deliveries(deliveries)
    first = batch[0].binding
    identity = StepIdentity(
        as_uuid("community_id", community_id), first.run_id, first.step_id, False, using
    )
    shared, params = identity._values(message_event_created_at, batch)
    lock = [str(identity.community_id), str(identity.run_id), identity.step_id]
    # One statement takes the step's identity lock and inserts every row: in
    # autocommit it is its own transaction (all rows or none), else the caller's.
    insert = sql.LOCK_AND_INSERT_SHARED_DELIVERIES if shared else sql.LOCK_AND_INSERT_DELIVERIES
    return _insert_deliveries(insert, [*lock, identity.community_id, *params], using)


from .sending import send_message  # noqa: E402  (the one-call producer, built on the above)


def _claim_filters(
    community_id: UUID,
    target_pubkey: bytes,
    delivery_id: UUID | None,
    expected: DeliveryBinding | None,
) -> dict[str, object]:
    filters: dict[str, object] = {
        "community_id": community_id,
        "target_pubkey": target_pubkey,
    }
    if delivery_id is not None:
        filters["id"] = delivery_id
    if expected is not None:
        filters.update(
            workflow_id=expected.workflow_id,
            run_id=expected.run_id,
            step_id=expected.step_id,
            definition_event_id=expected.definition_event_id,
            message_event_id=expected.message_event_id,
            cause_kind=expected.cause.kind.value,
        )
        _, event_id, scheduled_for, invocation_id = db.cause_columns(expected)
        if event_id is not None:
            filters["cause_event_id"] = event_id
        elif scheduled_for is not None:
            filters["cause_scheduled_for"] = scheduled_for
        else:
            filters["cause_webhook_invocation_id"] = invocation_id
    return filters


def claim_delivery(
    community_id: UUID | str,
    target_pubkey: bytes,
    *,
    delivery_id: UUID | str | None = None,
    expected: DeliveryBinding | None = None,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[Lease, DeliveryRecord] | None:
    """Claim the target's oldest pending delivery in the community (or exactly
    ``delivery_id``, or only one matching ``expected`` in every field). A miss is None."""
    community_id = as_uuid("community_id", community_id)
    target_pubkey = as_bytes32("target_pubkey", target_pubkey)
    seconds = _lease_seconds(lease_seconds)
    if delivery_id is not None:
        delivery_id = as_uuid("delivery_id", delivery_id)
    if expected is not None:
        if not isinstance(expected, DeliveryBinding):
            raise ProtocolError("expected", "must be a DeliveryBinding")
        if expected.community_id != community_id or expected.target_pubkey != target_pubkey:
            return None
    filters = _claim_filters(community_id, target_pubkey, delivery_id, expected)
    statement, params = db.claim_statement(filters, using)
    # One statement: the locking SELECT and the UPDATE share one transaction (the
    # statement's own in autocommit, or the caller's), so the row lock lasts exactly
    # as long as needed.
    rows = db.fetch(using, statement, [*params, seconds])
    if not rows:
        return None
    counters.CLAIMS.inc()
    record = db.record(rows[0])
    return stored_lease(community_id, target_pubkey, record), record


def renew_delivery(
    lease: Lease, *, lease_seconds: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> Renewed | LeaseLost:
    """Extend a live lease to now() + lease_seconds; an expired, reaped or superseded
    lease is lost and cannot revive itself."""
    params = _lease_params(lease)
    seconds = _lease_seconds(lease_seconds)
    rows = db.fetch(using, sql.RENEW, [seconds, *params])
    if not rows:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    return Renewed(lease_until=rows[0][0])


def finish_delivery(
    lease: Lease,
    outcome: Outcome | str,
    *,
    error: str | BaseException | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Settled | AlreadyTerminal | LeaseLost:
    """Settle the delivery once. A retry by the same capability after a settle
    reports the recorded status; anyone else gets LeaseLost.

    ``error`` (only with ``failed``) is kept as the delivery's last error, as
    ``retry_delivery`` keeps it, and the timeline's ``failed`` entry carries it with
    its traceback: a failure for good, never retried."""
    params = _lease_params(lease)
    outcome = _outcome(outcome)
    if error is not None:
        if outcome is not Outcome.FAILED:
            raise ProtocolError("error", "only a failed outcome records an error")
        report = error_report(error)
        statement = sql.FAIL_WITH_ERROR
        values = [report.traceback or "", report.type, report.message, *params]
    else:
        statement, values = sql.FINISH, [outcome.value, *params]
    if db.fetch(using, statement, values):
        counters.SETTLED[outcome.value].inc()
        return Settled(outcome=outcome)
    # Nothing settled: look at the row by the caller's full capability (same
    # generation), in a fresh statement so a concurrent settle is visible.
    rows = db.fetch(using, sql.STATUS_BY_CAPABILITY, params)
    if rows and DeliveryStatus(rows[0][0]).is_terminal:
        return AlreadyTerminal(status=DeliveryStatus(rows[0][0]))
    counters.LEASES_LOST.inc()
    return LeaseLost()


def _backoff_setting(name: str) -> float:
    value = getattr(app_settings, name)
    if not is_delay_seconds(value):
        raise WorkflowDeliveryConfigurationError(
            f"WORKFLOW_DELIVERY_{name} must be a number of seconds from 0 to "
            f"{LEASE_SECONDS_BOUND}, not {value!r}"
        )
    return float(value)


def retry_delivery(
    lease: Lease,
    *,
    error: str | BaseException,
    delay_seconds: float | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Retried | Exhausted | LeaseLost:
    """Give a live lease back after a failed attempt, in one statement: the delivery
    returns to pending with its fence bumped (the lease is dead), keeps ``error`` as
    its last error (an exception's type and message, or a string; the traceback goes
    to its timeline entry, ``retried``), and no claim takes it before
    ``Retried.available_at``, ``delay_seconds`` from now by the database clock.

    Without ``delay_seconds`` the wait grows with the attempts used:
    min(``WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS``,
    ``WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS`` * 2^(attempts - 1)), times a random
    factor from 0.5 to 1. A delivery that has used ``WORKFLOW_DELIVERY_MAX_ATTEMPTS``
    claims is settled ``failed`` instead (``Exhausted``; its timeline entry is
    ``attempts_exhausted``), as the reaper settles such a lease. A lease that is no
    longer live changes nothing (``LeaseLost``).

    Only a live lease is retried: a settled delivery never reopens. To try a failed
    delivery again, commit a new delivery for the same message under a new step id."""
    params = _lease_params(lease)
    report = error_report(error)
    if delay_seconds is not None and not is_delay_seconds(delay_seconds):
        raise ProtocolError(
            "delay_seconds",
            f"must be a number of seconds from 0 to {LEASE_SECONDS_BOUND}, not {delay_seconds!r}",
        )
    base = _backoff_setting("RETRY_BACKOFF_SECONDS")
    most = _backoff_setting("RETRY_BACKOFF_MAX_SECONDS")
    delay = None if delay_seconds is None else float(delay_seconds)
    values = [report.traceback or "", report.type, report.message]
    values += [_max_attempts(), delay, base, most, *params]
    rows = db.fetch(using, sql.RETRY, values)
    if not rows:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    status, available_at, attempts = rows[0]
    if status == DeliveryStatus.FAILED:
        counters.SETTLED[Outcome.FAILED.value].inc()
        return Exhausted(attempts=attempts)
    return Retried(available_at=available_at, attempts=attempts)


class Held:
    """The row lock of a live lease inside ``holding()``; ``finish`` settles there."""

    def __init__(self, lease: Lease, using: str) -> None:
        self.lease = lease
        self.settled: Settled | None = None
        self.refused = False
        self._using = using

    def __repr__(self) -> str:
        return f"Held(delivery_id={self.lease.delivery_id}, settled={self.settled})"

    def finish(self, outcome: Outcome | str) -> Settled:
        """Settle the delivery in the block's transaction: it commits with the block's
        other writes. Raises ``LeaseLostError`` if the lease ran out during the block
        (the block then rolls back, even if the caller catches it)."""
        outcome = _outcome(outcome)
        if self.settled is not None:
            raise ProtocolError("outcome", "this block has already settled its delivery")
        with db.cursor(self._using, savepoint=False) as cursor:
            cursor.execute(sql.HELD_FINISH, [outcome.value, *_lease_params(self.lease)])
            settled = cursor.fetchone() is not None
        if not settled:
            self.refused = True
            counters.LEASES_LOST.inc()
            raise LeaseLostError(self.lease, "the lease ran out inside the holding() block")
        # Counted once the block's transaction commits: until then it may roll back.
        transaction.on_commit(counters.SETTLED[outcome.value].inc, using=self._using)
        self.settled = Settled(outcome=outcome)
        return self.settled


@contextmanager
def holding(lease: Lease, *, using: str = DEFAULT_DB_ALIAS) -> Iterator[Held]:
    """Lease-fenced effects: a transaction that holds the delivery's row while the
    lease is live. The caller's writes in the block, and ``held.finish(outcome)``,
    commit together, or not at all.

    Entry locks the row (``FOR UPDATE``, waiting behind a brief locker such as a renew
    or the reaper) only while the lease is live, then asks again on its own clock:
    a lease reaped, released, superseded or settled before the block, or one that ran
    out while the block waited for the row, raises ``LeaseLostError``. While the block
    holds the row the reaper skips it and no newer holder can exist. A block that does
    not finish asks once more before it commits and rolls back (``LeaseLostError``)
    if the lease ran out inside it. So effects written inside ``holding()`` commit
    only under the live lease, and a block that finishes the delivery is the last any
    holder can commit: an effect written in that block happens exactly once.

    Entry takes the community's shared deletion lock before the row, as every
    writer does, and holds it to the end: a deletion of the community (a lifecycle
    move, a purge) waits for the block, and the block waits for one in progress.

    The row lock also holds back the holder's own heartbeat (``renew_delivery`` waits
    for it), so renew just before entering and keep the block well inside the lease.
    Nested in a caller's transaction, the block is a savepoint and the row stays
    locked until that transaction ends.
    """
    params = _lease_params(lease)
    with transaction.atomic(using=using):
        # Lock, then re-check: the locking statement's WHERE is re-read after a wait
        # but against the clock of its start, so expiry during the wait shows only
        # to a second statement. Both run in this block's transaction.
        with db.cursor(using, savepoint=False) as cursor:
            cursor.execute(sql.HOLD_LOCK, params)
            locked = cursor.fetchone() is not None
            if locked:
                cursor.execute(sql.HELD_LIVE, params)
                locked = cursor.fetchone() is not None
        if not locked:
            counters.LEASES_LOST.inc()
            raise LeaseLostError(lease)
        held = Held(lease, using)
        yield held
        if held.refused:
            raise LeaseLostError(lease, "the lease ran out inside the holding() block")
        if held.settled is None:
            # The row is still ours, so this answer holds until the commit.
            with db.cursor(using, savepoint=False) as cursor:
                cursor.execute(sql.HELD_LIVE, params)
                live = cursor.fetchone() is not None
            if not live:
                counters.LEASES_LOST.inc()
                raise LeaseLostError(lease, "the lease ran out inside the holding() block")


def _batch_size(value: object, default: int) -> int:
    size = default if value is None else value
    if not (is_whole_number(size) and size >= 1):
        raise ProtocolError("batch_size", f"must be a positive whole number, not {size!r}")
    return size


def _yield_ratio(value: object, default: float) -> float:
    ratio = default if value is None else value
    if not is_yield_ratio(ratio):
        raise ProtocolError("yield_ratio", f"must be a number from 0 to 100, not {ratio!r}")
    return ratio


def _max_attempts() -> int | None:
    cap = app_settings.MAX_ATTEMPTS
    if cap is not None and not (is_whole_number(cap) and cap >= 1):
        raise ProtocolError("WORKFLOW_DELIVERY_MAX_ATTEMPTS", f"must be None or >= 1, not {cap!r}")
    return cap


def _operator(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError("operator", f"must be a non-blank name, not {value!r}")
    return value


@contextmanager
def _transaction_as(actor: str, using: str) -> Iterator[Any]:
    """A transaction (or the caller's) whose statements the timeline trigger records as
    done by ``actor``. The setting is transaction-local, and cleared at the end of the
    block in case the transaction is the caller's and goes on."""
    with transaction.atomic(using=using), db.cursor(using, savepoint=False) as cursor:
        cursor.execute(sql.SET_ACTOR, [actor])
        yield cursor
        cursor.execute(sql.SET_ACTOR, [""])


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
    size = _batch_size(batch_size, app_settings.REAP_BATCH_SIZE)
    ratio = _yield_ratio(yield_ratio, app_settings.REAP_YIELD_RATIO)
    cap = _max_attempts()
    reclaimed = exhausted = 0

    def batch() -> int:
        nonlocal reclaimed, exhausted
        # Each batch is its own short transaction (unless the caller holds one), so a
        # sweep never holds more than ``size`` row locks at once. The statement writes
        # its own timeline entries and leaves no setting behind.
        ((count, failed, locked),) = db.fetch(using, sql.reap_batch(size, cap), [])
        if locked and on_locked is not None:
            on_locked(list(locked))
        reclaimed += count - failed
        exhausted += failed
        return count

    _batches(batch, size, ratio, on_batch, should_stop)
    counters.REAPED.labels("reclaimed").inc(reclaimed)
    counters.REAPED.labels("attempts_exhausted").inc(exhausted)
    return Reaped(reclaimed=reclaimed, exhausted=exhausted)


def claim_deliveries(
    community_id: UUID | str,
    target_pubkey: bytes,
    *,
    limit: int,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[tuple[Lease, DeliveryRecord]]:
    """Claim up to ``limit`` (1 to ``MAX_BATCH_SIZE``) of the target's oldest pending
    deliveries in the community, each under its own lease; oldest first, [] on a miss."""
    community_id = as_uuid("community_id", community_id)
    target_pubkey = as_bytes32("target_pubkey", target_pubkey)
    if not is_whole_number(limit) or not 1 <= limit <= MAX_BATCH_SIZE:
        raise ProtocolError(
            "limit", f"must be a whole number from 1 to {MAX_BATCH_SIZE}, not {limit!r}"
        )
    seconds = _lease_seconds(lease_seconds)
    # One statement: the locking SELECT and the UPDATE share its transaction, so the
    # row locks last exactly as long as needed (or the caller's transaction).
    rows = db.fetch(using, sql.CLAIM_BATCH, [community_id, target_pubkey, limit, seconds])
    records = [db.record(row) for row in rows]
    # UPDATE … RETURNING has no order of its own; hand the rows out as picked.
    records.sort(key=lambda record: (record.created_at, record.id))
    counters.CLAIMS.inc(len(records))
    return [(stored_lease(community_id, target_pubkey, record), record) for record in records]


def _outcome(value: object) -> Outcome:
    try:
        return Outcome(value)
    except ValueError:
        raise ProtocolError("outcome", f"must be finished or failed, not {value!r}") from None


def finish_deliveries(
    settlements: Iterable[tuple[Lease, Outcome | str]], *, using: str = DEFAULT_DB_ALIAS
) -> list[Settled | AlreadyTerminal | LeaseLost]:
    """Settle many leases in one statement; one result per input pair, in input order,
    each what ``finish_delivery`` would have returned for that pair called in turn.

    A capability repeated in the input is settled once, by its first occurrence (and
    its outcome); a later repeat reports the recorded status, as a retry would."""
    if isinstance(settlements, str | bytes) or not isinstance(settlements, Iterable):
        raise ProtocolError("settlements", "must be a list of (lease, outcome) pairs")
    pairs = list(settlements)
    if len(pairs) > MAX_BATCH_SIZE:
        raise ProtocolError(
            "settlements", f"at most {MAX_BATCH_SIZE} leases per call, not {len(pairs)}"
        )
    first_of: dict[tuple, int] = {}
    slots: list[int] = []
    columns: list[list[object]] = [[], [], [], [], []]
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ProtocolError("settlements", "each item must be a (lease, outcome) pair")
        params = _lease_params(pair[0])
        outcome = _outcome(pair[1])
        key = tuple(params)
        if key not in first_of:
            first_of[key] = len(columns[0])
            for column, value in zip(columns, [*params, outcome.value], strict=True):
                column.append(value)
        slots.append(first_of[key])
    if not pairs:
        return []
    rows = db.fetch(using, sql.FINISH_BATCH, columns)
    distinct: list[Settled | AlreadyTerminal | LeaseLost] = [LeaseLost()] * len(columns[0])
    for n, settled, status in rows:
        if settled:
            distinct[n - 1] = Settled(outcome=Outcome(columns[4][n - 1]))
            counters.SETTLED[columns[4][n - 1]].inc()
        elif status is not None and DeliveryStatus(status).is_terminal:
            distinct[n - 1] = AlreadyTerminal(status=DeliveryStatus(status))
    counters.LEASES_LOST.inc(sum(isinstance(result, LeaseLost) for result in distinct))
    results: list[Settled | AlreadyTerminal | LeaseLost] = []
    reported: set[int] = set()
    for slot in slots:
        result = distinct[slot]
        if slot in reported and isinstance(result, Settled):
            # The repeat of a capability that just settled: what a retry would see.
            result = AlreadyTerminal(status=DeliveryStatus(result.outcome.value))
        reported.add(slot)
        results.append(result)
    return results


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
    size = _batch_size(batch_size, app_settings.PRUNE_BATCH_SIZE)
    ratio = _yield_ratio(yield_ratio, app_settings.PRUNE_YIELD_RATIO)
    total = 0

    def batch() -> int:
        nonlocal total
        # One short transaction per batch: the try-locks on the communities and the
        # row locks end with it.
        count = len(db.fetch(using, sql.PRUNE_BATCH, [cutoff, size]))
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
    with db.cursor(using) as cursor:
        cursor.execute(sql.PRUNE_CUTOFF, [age])
        return cursor.fetchone()[0]


def count_prunable(
    older_than: timedelta | str | None = None, *, using: str = DEFAULT_DB_ALIAS
) -> dict[str, int]:
    """What ``prune_deliveries`` would delete now, by community host (active ones)."""
    cutoff = prune_cutoff(older_than, using=using)
    with db.cursor(using) as cursor:
        cursor.execute(sql.PRUNE_COUNT, [cutoff])
        return {host: count for _, host, count in cursor.fetchall()}


def get_delivery(
    community_id: UUID | str, delivery_id: UUID | str, *, using: str = DEFAULT_DB_ALIAS
) -> DeliveryRecord | None:
    """The delivery's record within its community, or None."""
    community_id = as_uuid("community_id", community_id)
    delivery_id = as_uuid("delivery_id", delivery_id)
    row = (
        WorkflowAgentDelivery.objects.using(using)
        .filter(community_id=community_id, id=delivery_id)
        .values_list(*sql.RECORD_COLUMNS)
        .first()
    )
    return db.record(row) if row is not None else None


def _operator_update(
    statement: str,
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    operator: str | None,
    using: str,
) -> list[UUID]:
    community_id = as_uuid("community_id", community_id)
    ids = [as_uuid("delivery_id", value) for value in delivery_ids]
    actor = "operator" if operator is None else f"operator:{_operator(operator)}"
    if not ids:
        return []
    # The statement writes its timeline entries itself, by ``actor``.
    params = [community_id, community_id, community_id, ids, community_id, actor]
    return [row[0] for row in db.fetch(using, statement, params)]


def release_deliveries(
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    *,
    operator: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Operator release: claimed rows of an active community go back to pending with
    the fence bumped, so their live holders are fenced out. Returns the ids released.
    The timeline records the actor as ``operator:<operator>``."""
    return _operator_update(sql.RELEASE, community_id, delivery_ids, operator, using)


def release_lease(lease: Lease, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """The holder gives its live lease back: the delivery returns to pending with the
    fence bumped. False (nothing changed) when the lease was no longer live."""
    return bool(db.fetch(using, sql.RELEASE_LEASE, _lease_params(lease)))


def fail_deliveries(
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    *,
    operator: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Operator terminal: pending or claimed rows of an active community become
    ``failed``. Returns the ids marked. The timeline records ``operator:<operator>``."""
    return _operator_update(sql.MARK_FAILED, community_id, delivery_ids, operator, using)


def record_request_event(
    community_id: UUID | str,
    event_id: bytes,
    created_at: int,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[bool, bool]:
    """The agent API's freshness check and replay guard for one signed request event,
    by the database clock: ``(fresh, recorded)``. A fresh event is recorded once,
    whatever the community; ``recorded`` is False when the same event was already
    accepted, even by another process at the same instant or for another community.
    A fenced community raises ``CommunityWriteFenced`` (the guard is a tenant table
    behind the write fence)."""
    community_id = as_uuid("community_id", community_id)
    event_id, created_at = _request_event(event_id, created_at)
    skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
    params = [created_at, skew, community_id, event_id, created_at]
    ((fresh, recorded),) = db.fetch(using, sql.ACCEPT_REQUEST_EVENT, params)
    return bool(fresh), bool(recorded)


def _request_event(event_id: bytes, created_at: int) -> tuple[bytes, int]:
    event_id = as_bytes32("event_id", event_id)
    if not is_whole_number(created_at) or not 0 <= created_at < 2**40:
        raise ProtocolError("created_at", f"must be a whole number of seconds, not {created_at!r}")
    return event_id, created_at


def admit_request_event(
    host: str,
    event_id: bytes,
    created_at: int,
    *,
    pubkey: bytes,
    using: str = DEFAULT_DB_ALIAS,
) -> RequestAdmission:
    """The agent API's look-up of the community served at ``host`` (any case) and of
    where ``pubkey`` stands in its agent roster, with the freshness check and the
    replay guard of ``record_request_event``, in one statement. Only an enabled
    agent's event is recorded. In the caller's transaction the replay row commits or
    rolls back with the caller's work, and the roster's shared lock is held until
    then (a revocation of the key waits for the request); an unknown host records
    nothing."""
    if not isinstance(host, str) or not host:
        raise ProtocolError("host", f"must be a host name, not {host!r}")
    event_id, created_at = _request_event(event_id, created_at)
    pubkey = as_bytes32("pubkey", pubkey)
    skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
    params = [created_at, skew, host, pubkey, event_id, created_at]
    ((community_id, fresh, recorded, standing),) = db.fetch(
        using, sql.ADMIT_REQUEST_EVENT, params, savepoint=False
    )
    return RequestAdmission(
        community_id=community_id,
        fresh=bool(fresh),
        recorded=bool(recorded),
        standing=None if standing is None else AgentStanding(standing),
    )


def message_events(
    community_id: UUID | str, records: Iterable[DeliveryRecord], *, using: str = DEFAULT_DB_ALIAS
) -> dict[UUID, MessageEvent]:
    """The message event of each record (by delivery id), read in one query."""
    community_id = as_uuid("community_id", community_id)
    wanted = {
        (record.message_event_created_at, record.binding.message_event_id): record.id
        for record in records
    }
    if not wanted:
        return {}
    ids = [event_id for _, event_id in wanted]
    # A read: in the API's request transaction it needs no savepoint of its own.
    rows = db.fetch(using, sql.MESSAGE_EVENTS, [community_id, ids], savepoint=False)
    found: dict[UUID, MessageEvent] = {}
    for event_id, created_at, pubkey, kind, tags, content in rows:
        delivery_id = wanted.get((created_at, bytes(event_id)))
        if delivery_id is not None:
            found[delivery_id] = MessageEvent(
                id=bytes(event_id),
                pubkey=bytes(pubkey),
                created_at=created_at,
                kind=kind,
                tags=json.loads(tags),
                content=content,
            )
    return found


def prune_replay_guard(
    *, batch_size: int = 1000, max_batches: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Delete the replay-guard rows whose events can no longer pass the freshness
    window (kept one extra window, so a request checked just before a prune cannot
    slip past its twin), in bounded batches; returns how many were deleted. A
    community being deleted is skipped, not waited for."""
    if not (is_whole_number(batch_size) and batch_size >= 1):
        raise ProtocolError("batch_size", f"must be a positive whole number, not {batch_size!r}")
    horizon = 2 * app_settings.API_MAX_CLOCK_SKEW_SECONDS
    total, batches = 0, 0
    while max_batches is None or batches < max_batches:
        # Each batch is its own short transaction (unless the caller holds one).
        try:
            with db.cursor(using) as cursor:
                cursor.execute(sql.PRUNE_REPLAYS_BATCH, [horizon, batch_size])
                count = cursor.rowcount
        except CommunityWriteFenced:
            # A tenant was fenced between our look at it and the delete; the next
            # sweep skips it.
            return total
        total += count
        batches += 1
        if count < batch_size:
            break
    return total
