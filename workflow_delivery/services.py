"""Every state change of a delivery: identity lock + commit, claim, renew, finish, reap.

Functions own their transaction (or join the caller's), take the database clock
for every time, and return frozen values from ``protocol``. Expected outcomes (a
miss, a lost lease) are values; database rule violations become named exceptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, transaction

from . import db, sql
from .conf import app_settings, is_whole_number, is_yield_ratio
from .exceptions import BindingScopeError, InvalidLeaseSeconds, ProtocolError
from .models import WorkflowAgentDelivery
from .protocol import (
    AlreadyTerminal,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    Renewed,
    Settled,
    as_bytes32,
    as_datetime,
    as_step_id,
    as_uuid,
)

__all__ = [
    "MAX_BATCH_SIZE",
    "StepIdentity",
    "claim_deliveries",
    "claim_delivery",
    "commit_deliveries",
    "delivery_identity",
    "fail_deliveries",
    "finish_deliveries",
    "finish_delivery",
    "get_delivery",
    "reap_expired_deliveries",
    "release_deliveries",
    "renew_delivery",
]


# The most leases one claim_deliveries or finish_deliveries call handles: a bound on
# the row locks one statement takes and on the size of its array parameters.
MAX_BATCH_SIZE = 1000


def _lease_seconds(value: object) -> int:
    maximum = app_settings.MAX_LEASE_SECONDS
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

    def __repr__(self) -> str:
        return (
            f"StepIdentity(community_id={self.community_id}, run_id={self.run_id}, "
            f"step_id={self.step_id!r}, exists={self.exists})"
        )

    def _validate(self, batch: list[NewDelivery]) -> None:
        ids, targets = set(), set()
        message = None
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
            if message is not None and binding.message_event_id != message:
                raise ProtocolError(
                    "message_event_id", "every delivery of a step carries the same message event"
                )
            message = binding.message_event_id
            if item.id in ids:
                raise ProtocolError("id", f"delivery id {item.id} appears twice in one commit")
            if binding.target_pubkey in targets:
                raise ProtocolError(
                    "target_pubkey",
                    f"target {binding.target_pubkey.hex()} appears twice in one commit",
                )
            ids.add(item.id)
            targets.add(binding.target_pubkey)

    def _values(
        self, message_event_created_at: datetime, batch: list[NewDelivery]
    ) -> tuple[int, list[object]]:
        """The insert's parameters for a batch checked by ``_new_deliveries``."""
        created_at = as_datetime("message_event_created_at", message_event_created_at)
        self._validate(batch)
        params: list[object] = []
        for item in batch:
            b = item.binding
            params += [
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
        return len(batch), params

    def commit(
        self, message_event_created_at: datetime, deliveries: Iterable[NewDelivery]
    ) -> list[UUID]:
        """Insert the step's deliveries at once; return the ids actually created.
        An existing (community, run, step, target) is skipped, so a retry creates nothing."""
        count, params = self._values(message_event_created_at, _new_deliveries(deliveries))
        with db.cursor(self._using, savepoint=False) as cursor:
            cursor.execute(sql.insert_deliveries(count), params)
            created = [row[0] for row in cursor.fetchall()]
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
        yield StepIdentity(community_id, run_id, step_id, exists, using)


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
    count, params = identity._values(message_event_created_at, batch)
    lock = [str(identity.community_id), str(identity.run_id), identity.step_id]
    # One statement takes the step's identity lock and inserts every row: in
    # autocommit it is its own transaction (all rows or none), else the caller's.
    with db.cursor(using) as cursor:
        cursor.execute(sql.lock_and_insert_deliveries(count), [*lock, *params])
        return [row[0] for row in cursor.fetchall()]


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
    with db.cursor(using) as cursor:
        cursor.execute(statement, [*params, seconds])
        row = cursor.fetchone()
    if row is None:
        return None
    record = db.record(row)
    lease = Lease(
        community_id=community_id,
        delivery_id=record.id,
        target_pubkey=target_pubkey,
        generation=record.lease_generation,
        lease_until=record.lease_until,
    )
    return lease, record


def renew_delivery(
    lease: Lease, *, lease_seconds: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> Renewed | LeaseLost:
    """Extend a live lease to now() + lease_seconds; an expired, reaped or superseded
    lease is lost and cannot revive itself."""
    params = _lease_params(lease)
    seconds = _lease_seconds(lease_seconds)
    with db.cursor(using) as cursor:
        cursor.execute(sql.RENEW, [seconds, *params])
        row = cursor.fetchone()
    return Renewed(lease_until=row[0]) if row else LeaseLost()


def finish_delivery(
    lease: Lease, outcome: Outcome | str, *, using: str = DEFAULT_DB_ALIAS
) -> Settled | AlreadyTerminal | LeaseLost:
    """Settle the delivery once. A retry by the same capability after a settle
    reports the recorded status; anyone else gets LeaseLost."""
    params = _lease_params(lease)
    outcome = _outcome(outcome)
    with db.cursor(using) as cursor:
        cursor.execute(sql.FINISH, [outcome.value, *params])
        if cursor.fetchone() is not None:
            return Settled(outcome=outcome)
        # Nothing settled: look at the row by the caller's full capability (same
        # generation), in a fresh statement so a concurrent settle is visible.
        cursor.execute(sql.STATUS_BY_CAPABILITY, params)
        row = cursor.fetchone()
    if row is not None and DeliveryStatus(row[0]).is_terminal:
        return AlreadyTerminal(status=DeliveryStatus(row[0]))
    return LeaseLost()


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
    with db.cursor(using) as cursor:
        cursor.execute(sql.CLAIM_BATCH, [community_id, target_pubkey, limit, seconds])
        records = [db.record(row) for row in cursor.fetchall()]
    # UPDATE … RETURNING has no order of its own; hand the rows out as picked.
    records.sort(key=lambda record: (record.created_at, record.id))
    return [
        (
            Lease(
                community_id=community_id,
                delivery_id=record.id,
                target_pubkey=target_pubkey,
                generation=record.lease_generation,
                lease_until=record.lease_until,
            ),
            record,
        )
        for record in records
    ]


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
    with db.cursor(using) as cursor:
        cursor.execute(sql.FINISH_BATCH, columns)
        rows = cursor.fetchall()
    distinct: list[Settled | AlreadyTerminal | LeaseLost] = [LeaseLost()] * len(columns[0])
    for n, settled, status in rows:
        if settled:
            distinct[n - 1] = Settled(outcome=Outcome(columns[4][n - 1]))
        elif status is not None and DeliveryStatus(status).is_terminal:
            distinct[n - 1] = AlreadyTerminal(status=DeliveryStatus(status))
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
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Return every expired lease of every active community to pending, bumping its
    fence, in bounded batches until none is left; returns how many were reclaimed.

    After a full batch the sweep rests ``yield_ratio`` times as long as that batch
    took (default ``WORKFLOW_DELIVERY_REAP_YIELD_RATIO``), so a large backlog leaves
    the database to live holders part of the time; 0 sweeps flat out.
    ``on_batch(count, seconds)`` observes each batch; ``should_stop()`` ends the sweep
    between batches."""
    size = app_settings.REAP_BATCH_SIZE if batch_size is None else batch_size
    if not (is_whole_number(size) and size >= 1):
        raise ProtocolError("batch_size", f"must be a positive whole number, not {size!r}")
    ratio = app_settings.REAP_YIELD_RATIO if yield_ratio is None else yield_ratio
    if not is_yield_ratio(ratio):
        raise ProtocolError("yield_ratio", f"must be a number from 0 to 100, not {ratio!r}")
    total = 0
    while True:
        started = time.monotonic()
        # Each batch is its own short transaction (unless the caller holds one), so a
        # sweep never holds more than ``size`` row locks at once.
        with db.cursor(using) as cursor:
            cursor.execute(sql.REAP_BATCH, [size])
            count = len(cursor.fetchall())
        elapsed = time.monotonic() - started
        total += count
        if on_batch is not None:
            on_batch(count, elapsed)
        if count < size or (should_stop is not None and should_stop()):
            return total
        if ratio:
            time.sleep(elapsed * ratio)


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
    statement: str, community_id: UUID | str, delivery_ids: Iterable[UUID | str], using: str
) -> list[UUID]:
    community_id = as_uuid("community_id", community_id)
    ids = [as_uuid("delivery_id", value) for value in delivery_ids]
    if not ids:
        return []
    with db.cursor(using) as cursor:
        cursor.execute(statement, [community_id, ids])
        return [row[0] for row in cursor.fetchall()]


def release_deliveries(
    community_id: UUID | str, delivery_ids: Iterable[UUID | str], *, using: str = DEFAULT_DB_ALIAS
) -> list[UUID]:
    """Operator release: claimed rows of an active community go back to pending with
    the fence bumped, so their live holders are fenced out. Returns the ids released."""
    return _operator_update(sql.RELEASE, community_id, delivery_ids, using)


def fail_deliveries(
    community_id: UUID | str, delivery_ids: Iterable[UUID | str], *, using: str = DEFAULT_DB_ALIAS
) -> list[UUID]:
    """Operator terminal: pending or claimed rows of an active community become
    ``failed``. Returns the ids marked."""
    return _operator_update(sql.MARK_FAILED, community_id, delivery_ids, using)
