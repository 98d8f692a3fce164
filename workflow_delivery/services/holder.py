"""The agent's side of a delivery: claim it under a lease (one or a batch), renew,
finish, retry or give it back, hold its row for lease-fenced effects, register as
idle when nothing is left to claim, and read a delivery's record and message.

Claim, renew and finish are the hot path."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, transaction

from .. import counters
from ..conf import app_settings
from ..exceptions import (
    InvalidLeaseSeconds,
    LeaseNotLive,
    ProtocolError,
    WorkflowDeliveryConfigurationError,
)
from ..models import TurnOutcome, WorkflowAgentDelivery
from ..protocol import (
    AlreadyTerminal,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    ErrorReport,
    Exhausted,
    FinishedAndNext,
    Lease,
    LeaseLost,
    MessageEvent,
    Outcome,
    Renewed,
    Retried,
    Settled,
    as_bytes32,
    as_uuid,
    error_report,
    stored_lease,
    stored_message,
)
from ..store import rows, run, statements
from ..store.wake import ListenerSession
from ..validation import (
    LEASE_SECONDS_BOUND,
    checked_public_keys,
    is_delay_seconds,
    is_whole_number,
)
from ._common import max_attempts

# A lease built only to check its fields: the database judges expiry by its own clock.
_NO_TIME = datetime.min.replace(tzinfo=UTC)

# The most leases one claim_deliveries or finish_deliveries call handles: a bound on
# the row locks one statement takes and on the size of its array parameters.
MAX_BATCH_SIZE = 1000


def checked_lease_seconds(value: object) -> int:
    """A lease length as every claim path takes it: ``None`` is the configured default;
    anything but a whole number from 1 to the configured maximum is
    ``InvalidLeaseSeconds`` naming ``lease_seconds``."""
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


def _lease_params(lease: object) -> dict[str, object]:
    if not isinstance(lease, Lease):
        raise ProtocolError("lease", f"must be a Lease, not {type(lease).__name__}")
    return {
        "community_id": lease.community_id,
        "delivery_id": lease.delivery_id,
        "target_pubkey": lease.target_pubkey,
        "generation": lease.generation,
    }


def _error_params(report: ErrorReport) -> dict[str, object]:
    return {
        "traceback": report.traceback or "",
        "error_type": report.type,
        "error_message": report.message,
    }


def _checked_outcome(value: object) -> Outcome:
    try:
        return Outcome(value)
    except ValueError:
        raise ProtocolError("outcome", f"must be finished or failed, not {value!r}") from None


# The claim statements by shape: any row of the target (with a limit), one delivery
# id, an expected binding (by its cause's column), both.
_CLAIMS = (
    statements.CLAIM,
    statements.CLAIM_BY_ID,
    statements.CLAIM_EXPECTED,
    statements.CLAIM_BY_ID_EXPECTED,
)
_SERVED_CLAIMS = (
    statements.SERVED_CLAIM,
    statements.SERVED_CLAIM_BY_ID,
    statements.SERVED_CLAIM_EXPECTED,
    statements.SERVED_CLAIM_BY_ID_EXPECTED,
)


def _claim_statement(
    params: dict[str, object],
    delivery_id: UUID | None,
    expected: DeliveryBinding | None,
    shapes: tuple = _CLAIMS,
) -> statements.Statement:
    """The claim statement of this shape among ``shapes``, its extra parameters added
    to ``params``."""
    anything, by_id, by_expected, by_id_expected = shapes
    if delivery_id is not None:
        params["delivery_id"] = delivery_id
    if expected is None:
        return anything if delivery_id is None else by_id
    params.update(
        expected_community_id=expected.community_id,
        expected_target_pubkey=expected.target_pubkey,
        workflow_id=expected.workflow_id,
        run_id=expected.run_id,
        step_id=expected.step_id,
        definition_event_id=expected.definition_event_id,
        message_event_id=expected.message_event_id,
    )
    kind, event_id, scheduled_for, invocation_id = rows.cause_columns(expected)
    if event_id is not None:
        column, value = "cause_event_id", event_id
    elif scheduled_for is not None:
        column, value = "cause_scheduled_for", scheduled_for
    else:
        column, value = "cause_webhook_invocation_id", invocation_id
    params["cause_kind"] = kind
    params[column] = value
    return (by_expected if delivery_id is None else by_id_expected)[column]


def _expected_binding(expected: object) -> DeliveryBinding | None:
    if expected is not None and not isinstance(expected, DeliveryBinding):
        raise ProtocolError("expected", "must be a DeliveryBinding")
    return expected


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
    seconds = checked_lease_seconds(lease_seconds)
    if delivery_id is not None:
        delivery_id = as_uuid("delivery_id", delivery_id)
    if _expected_binding(expected) is not None and (
        expected.community_id != community_id or expected.target_pubkey != target_pubkey
    ):
        return None
    params = {
        "community_id": community_id,
        "target_pubkey": target_pubkey,
        "lease_seconds": seconds,
    }
    statement = _claim_statement(params, delivery_id, expected)
    # One statement: the locking SELECT and the UPDATE share one transaction (the
    # statement's own in autocommit, or the caller's), so the row lock lasts exactly
    # as long as needed.
    claimed = run.fetch(using, statement, params)
    if not claimed:
        return None
    counters.CLAIMS.inc()
    record = rows.record(claimed[0])
    return stored_lease(community_id, target_pubkey, record), record


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
    seconds = checked_lease_seconds(lease_seconds)
    # One statement: the locking SELECT and the UPDATE share its transaction, so the
    # row locks last exactly as long as needed (or the caller's transaction).
    params = {
        "community_id": community_id,
        "target_pubkey": target_pubkey,
        "limit": limit,
        "lease_seconds": seconds,
    }
    records = [rows.record(row) for row in run.fetch(using, statements.CLAIM_BATCH, params)]
    # UPDATE … RETURNING has no order of its own; hand the rows out as picked.
    records.sort(key=lambda record: (record.created_at, record.id))
    counters.CLAIMS.inc(len(records))
    return [(stored_lease(community_id, target_pubkey, record), record) for record in records]


def renew_delivery(
    lease: Lease, *, lease_seconds: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> Renewed | LeaseLost:
    """Extend a live lease to now() + lease_seconds; an expired, reaped or superseded
    lease is lost and cannot revive itself."""
    params = _lease_params(lease)
    params["lease_seconds"] = checked_lease_seconds(lease_seconds)
    renewed = run.fetch(using, statements.RENEW, params)
    if not renewed:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    return Renewed(lease_until=renewed[0][0])


def renew_waiting_at_most(
    lease: Lease, *, lease_seconds: int, lock_timeout_ms: int, using: str = DEFAULT_DB_ALIAS
) -> Renewed | LeaseLost:
    """``renew_delivery`` that waits at most ``lock_timeout_ms`` for a lock (the
    deletion lock, the row) and raises ``DeliveryTimeout`` past it, in one statement
    (``statements.HEARTBEAT_RENEW``): the consumer's heartbeat. The wait's bound is
    transaction-local; in autocommit, where the heartbeat runs, it ends with the
    statement, and inside a caller's transaction it holds to that transaction's end."""
    params = _lease_params(lease)
    params["lease_seconds"] = checked_lease_seconds(lease_seconds)
    if not (is_whole_number(lock_timeout_ms) and lock_timeout_ms >= 1):
        raise ProtocolError(
            "lock_timeout_ms", f"must be a positive whole number, not {lock_timeout_ms!r}"
        )
    params["lock_timeout"] = f"{lock_timeout_ms}ms"
    renewed = run.fetch(using, statements.HEARTBEAT_RENEW, params)
    if not renewed:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    return Renewed(lease_until=renewed[0][0])


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
    params, outcome = _settle_params(lease, outcome, error)
    statement = statements.FINISH if error is None else statements.FAIL_WITH_ERROR
    settled = run.fetch(using, statement, params)
    if settled:
        return _settle_result(outcome, settled[0][0], None)
    # Nothing settled: look at the row by the caller's full capability (same
    # generation), in a fresh statement so a concurrent settle is visible.
    seen = run.fetch(using, statements.STATUS_BY_CAPABILITY, params)
    return _settle_result(outcome, None, seen[0][0] if seen else None)


def _settle_result(
    outcome: Outcome, settled: str | None, seen: str | None
) -> Settled | AlreadyTerminal | LeaseLost:
    """What a settle answers, from the status it settled (None: nothing was) and the
    status the lease's capability sees then: a terminal one is a retry of a settle
    (``AlreadyTerminal``), anything else a lost lease."""
    if settled is not None:
        counters.SETTLED[outcome.value].inc()
        return Settled(outcome=outcome)
    if seen is not None and DeliveryStatus(seen).is_terminal:
        return AlreadyTerminal(status=DeliveryStatus(seen))
    counters.LEASES_LOST.inc()
    return LeaseLost()


def _settle_params(
    lease: Lease, outcome: Outcome | str, error: str | BaseException | None
) -> tuple[dict[str, object], Outcome]:
    params = _lease_params(lease)
    outcome = _checked_outcome(outcome)
    if error is not None:
        if outcome is not Outcome.FAILED:
            raise ProtocolError("error", "only a failed outcome records an error")
        params.update(_error_params(error_report(error)))
    else:
        params["outcome"] = outcome.value
    return params, outcome


def finish_and_claim_next(
    lease: Lease,
    outcome: Outcome | str,
    *,
    error: str | BaseException | None = None,
    target_pubkey: bytes | None = None,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> FinishedAndNext:
    """Settle the delivery once, as ``finish_delivery`` does (same fences, same
    answers, ``error`` likewise), and in the same statement, so in one commit, claim
    the oldest claimable delivery of the lease's target (or of ``target_pubkey``, in
    the lease's community) as ``claim_delivery`` does. Only a settle claims: an
    ``AlreadyTerminal`` or ``LeaseLost`` result comes with no next delivery.

    In autocommit the settle and the claim commit together; an answer lost with the
    connection leaves the next delivery claimed until its lease runs out, as a lost
    claim answer does (a retry of the settle answers ``AlreadyTerminal``)."""
    params, outcome = _settle_params(lease, outcome, error)
    next_target = (
        lease.target_pubkey if target_pubkey is None else as_bytes32("target_pubkey", target_pubkey)
    )
    params["next_target_pubkey"] = next_target
    params["lease_seconds"] = checked_lease_seconds(lease_seconds)
    statement = (
        statements.FINISH_AND_CLAIM_NEXT
        if error is None
        else statements.FAIL_WITH_ERROR_AND_CLAIM_NEXT
    )
    ((settled, seen, *claimed),) = run.fetch(using, statement, params)
    result = _settle_result(outcome, settled, seen)
    if not isinstance(result, Settled) or claimed[0] is None:
        return FinishedAndNext(result=result)
    counters.CLAIMS.inc()
    record = rows.record(claimed)
    return FinishedAndNext(
        result=result, next=(stored_lease(lease.community_id, next_target, record), record)
    )


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
    names = ["community_ids", "delivery_ids", "target_pubkeys", "generations", "outcomes"]
    slots: list[int] = []
    columns: list[list[object]] = [[], [], [], [], []]
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ProtocolError("settlements", "each item must be a (lease, outcome) pair")
        params = _lease_params(pair[0])
        outcome = _checked_outcome(pair[1])
        key = tuple(params.values())
        if key not in first_of:
            first_of[key] = len(columns[0])
            for column, value in zip(columns, [*key, outcome.value], strict=True):
                column.append(value)
        slots.append(first_of[key])
    if not pairs:
        return []
    answers = run.fetch(using, statements.FINISH_BATCH, dict(zip(names, columns, strict=True)))
    distinct: list[Settled | AlreadyTerminal | LeaseLost] = [LeaseLost()] * len(columns[0])
    for n, settled, status in answers:
        outcome = Outcome(columns[4][n - 1])
        distinct[n - 1] = _settle_result(outcome, outcome.value if settled else None, status)
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

    Only a live lease is retried: a settled delivery never reopens here. An operator
    returns a failed one to pending with ``retry_failed_deliveries``."""
    params = _lease_params(lease)
    report = error_report(error)
    if delay_seconds is not None and not is_delay_seconds(delay_seconds):
        raise ProtocolError(
            "delay_seconds",
            f"must be a number of seconds from 0 to {LEASE_SECONDS_BOUND}, not {delay_seconds!r}",
        )
    base = _backoff_setting("RETRY_BACKOFF_SECONDS")
    most = _backoff_setting("RETRY_BACKOFF_MAX_SECONDS")
    params.update(_error_params(report))
    params.update(
        cap=max_attempts(),
        delay=None if delay_seconds is None else float(delay_seconds),
        base=base,
        most=most,
    )
    retried = run.fetch(using, statements.RETRY, params)
    if not retried:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    status, available_at, attempts = retried[0]
    if status == DeliveryStatus.FAILED:
        counters.SETTLED[Outcome.FAILED.value].inc()
        return Exhausted(attempts=attempts)
    return Retried(available_at=available_at, attempts=attempts)


def release_lease(lease: Lease, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """The holder gives its live lease back: the delivery returns to pending with the
    fence bumped. False (nothing changed) when the lease was no longer live."""
    return bool(run.fetch(using, statements.RELEASE_LEASE, _lease_params(lease)))


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
        other writes. Raises ``LeaseNotLive`` if the lease ran out during the block
        (the block then rolls back, even if the caller catches it)."""
        outcome = _checked_outcome(outcome)
        if self.settled is not None:
            raise ProtocolError("outcome", "this block has already settled its delivery")
        params = {**_lease_params(self.lease), "outcome": outcome.value}
        settled = bool(run.fetch(self._using, statements.HELD_FINISH, params, savepoint=False))
        if not settled:
            self.refused = True
            counters.LEASES_LOST.inc()
            raise LeaseNotLive(self.lease, "the lease ran out inside the holding() block")
        # Counted once the block's transaction commits: until then it may roll back.
        transaction.on_commit(counters.SETTLED[outcome.value].inc, using=self._using)
        self.settled = Settled(outcome=outcome)
        return self.settled


def keep_agent_turn(
    lease: Lease,
    *,
    attempts: int,
    outcome: str,
    text: str,
    said_bytes: int,
    stop_reason: str | None = None,
    tool_calls: Iterable[dict] = (),
    permissions: Iterable[dict] = (),
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Store what an ACP agent said in the turn of the attempt ``attempts`` of the
    lease's delivery: its streamed ``text`` (``said_bytes``: all it said, when the text
    was cut), its stop reason, tool calls and permission requests. Call it in the
    transaction of the settle that ended the attempt, after the settle counted
    (``Consumer`` does, through ``DeliveryContext.with_settle``): the database refuses
    a turn whose attempt still holds its claim, and a second turn of one attempt."""
    if outcome not in TurnOutcome.values:
        raise ProtocolError("outcome", f"must be one of {', '.join(TurnOutcome.values)}")
    params = {
        "community_id": lease.community_id,
        "delivery_id": lease.delivery_id,
        "generation": lease.generation,
        "attempts": attempts,
        "outcome": outcome,
        "stop_reason": stop_reason,
        "text": text,
        "said_bytes": said_bytes,
        "tool_calls": json.dumps(list(tool_calls)),
        "permissions": json.dumps(list(permissions)),
    }
    run.fetch(using, statements.KEEP_AGENT_TURN, params, savepoint=False)


@contextmanager
def holding(lease: Lease, *, using: str = DEFAULT_DB_ALIAS) -> Iterator[Held]:
    """Lease-fenced effects: a transaction that holds the delivery's row while the
    lease is live. The caller's writes in the block, and ``held.finish(outcome)``,
    commit together, or not at all.

    Entry locks the row (``FOR UPDATE``, waiting behind a brief locker such as a renew
    or the reaper) only while the lease is live, then asks again on its own clock:
    a lease reaped, released, superseded or settled before the block, or one that ran
    out while the block waited for the row, raises ``LeaseNotLive``. While the block
    holds the row the reaper skips it and no newer holder can exist. A block that does
    not finish asks once more before it commits and rolls back (``LeaseNotLive``)
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
        locked = bool(run.fetch(using, statements.HOLD_LOCK, params, savepoint=False))
        if locked:
            locked = bool(run.fetch(using, statements.HELD_LIVE, params, savepoint=False))
        if not locked:
            counters.LEASES_LOST.inc()
            raise LeaseNotLive(lease)
        held = Held(lease, using)
        yield held
        if held.refused:
            raise LeaseNotLive(lease, "the lease ran out inside the holding() block")
        if held.settled is None:
            # The row is still ours, so this answer holds until the commit.
            live = bool(run.fetch(using, statements.HELD_LIVE, params, savepoint=False))
            if not live:
                counters.LEASES_LOST.inc()
                raise LeaseNotLive(lease, "the lease ran out inside the holding() block")


def register_idle(
    community_id: UUID | str,
    targets: Iterable[bytes],
    *,
    session: ListenerSession | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Record that a consumer of ``targets`` found nothing to claim and is waiting for
    a wake-up: the next producer commit to one of them notifies (once) and consumes
    the registration. Call it only once the caller LISTENs, then poll once more
    before waiting: a delivery committed before the registration is found by that
    poll, one committed after it sends the wake. Commits on its own unless the
    caller's transaction is open.

    ``session`` is the session that LISTENs for the wake-up (``WakeListener.session``);
    without it, the session this runs on. The registration names it, so a registration
    left by a consumer that died shows as such: its session is gone. Registering again
    renews the registration with the new session and time."""
    if session is not None and not isinstance(session, ListenerSession):
        raise ProtocolError("session", "must be a store.wake.ListenerSession or None")
    _on_idle_targets(
        statements.REGISTER_IDLE,
        community_id,
        targets,
        using,
        pid=None if session is None else session.pid,
        backend_start=None if session is None else session.backend_start,
    )


def unregister_idle(
    community_id: UUID | str, targets: Iterable[bytes], *, using: str = DEFAULT_DB_ALIAS
) -> None:
    """Take back ``targets``' idle registrations, as a consumer does when it stops
    cleanly: no wake-up is sent for them until a consumer registers them again."""
    _on_idle_targets(statements.UNREGISTER_IDLE, community_id, targets, using)


def _on_idle_targets(
    statement: statements.Statement,
    community_id: UUID | str,
    targets: Iterable[bytes],
    using: str,
    **params: object,
) -> None:
    """``statement`` on the community's idle registrations of ``targets`` (checked,
    each once, in key order), with ``params`` besides; nothing for no targets."""
    community_id = as_uuid("community_id", community_id)
    keys = sorted(set(checked_public_keys("targets", targets)))
    if not keys:
        return
    run.fetch(using, statement, {"community_id": community_id, "target_pubkeys": keys, **params})


def get_delivery(
    community_id: UUID | str, delivery_id: UUID | str, *, using: str = DEFAULT_DB_ALIAS
) -> DeliveryRecord | None:
    """The delivery's record within its community, or None."""
    community_id = as_uuid("community_id", community_id)
    delivery_id = as_uuid("delivery_id", delivery_id)
    row = (
        WorkflowAgentDelivery.objects.using(using)
        .filter(community_id=community_id, id=delivery_id)
        .values_list(*rows.RECORD_COLUMNS)
        .first()
    )
    return rows.record(row) if row is not None else None


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
    params = {"community_id": community_id, "event_ids": ids}
    found: dict[UUID, MessageEvent] = {}
    for columns in run.fetch(using, statements.MESSAGE_EVENTS, params, savepoint=False):
        event_id, created_at = columns[0], columns[1]
        delivery_id = wanted.get((created_at, bytes(event_id)))
        if delivery_id is not None:
            found[delivery_id] = stored_message(*columns)
    return found
