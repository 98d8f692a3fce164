"""The agent's side of a delivery for the signed API: claim (one, exactly one, or a
batch), renew, finish, and finish-and-claim-next on a request admitted in the same
statement, and the claim of a request admitted earlier (a claim that waited).

Each admits the request (the host's community, the key's standing, freshness, the
replay guard) and, once admitted, runs the operation on the signing key's leases in
the same statement (``statements.SERVED_*``), built from the holder's claim and
live-lease rules, so in autocommit the replay row commits with the operation or not at
all. A request refused raises what ``replay.admitted_community`` raises, and records
and changes nothing. An operation that finds the lease lost rolls the whole statement
back, its replay row too, so an honest retry is judged afresh."""

from __future__ import annotations

from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from .. import counters
from ..exceptions import ConstraintViolation, ProtocolError
from ..protocol import (
    AlreadyTerminal,
    Claimed,
    DeliveryBinding,
    FinishedAndNext,
    Lease,
    LeaseLost,
    Outcome,
    Renewed,
    RequestEvent,
    Settled,
    as_bytes32,
    as_uuid,
    stored_lease,
    stored_message,
)
from ..store import rows, run, statements
from ..store.errors import REQUEST_REFUSED
from ..validation import is_whole_number
from .holder import (
    _NO_TIME,
    _SERVED_CLAIMS,
    MAX_BATCH_SIZE,
    _checked_outcome,
    _claim_statement,
    _expected_binding,
    _settle_result,
    checked_lease_seconds,
)
from .replay import _admission_params, _stored_admission, admitted_community

_RECORD = len(rows.RECORD_COLUMNS)
_ADMISSION = 4


def _claimed(community_id: UUID, target_pubkey: bytes, columns: tuple) -> Claimed | None:
    """A claimed record and its message (the event's columns NULL when it is not
    stored), as the API's claim statements answer them; None for a row of NULLs."""
    if columns[0] is None:
        return None
    record = rows.record(columns[:_RECORD])
    event = columns[_RECORD:]
    message = None if event[0] is None else stored_message(*event)
    counters.CLAIMS.inc()
    return Claimed(
        lease=stored_lease(community_id, target_pubkey, record), record=record, message=message
    )


def _run_admitted(
    request: RequestEvent, statement: statements.Statement, params: dict[str, object], using: str
) -> tuple[UUID, list[tuple]] | None:
    """The admitting statement's community and rows, or the refusal of its request;
    None when its operation refused (a lost lease: nothing was kept)."""
    try:
        answer = run.fetch(using, statement, params)
    except ConstraintViolation as exc:
        if exc.constraint != REQUEST_REFUSED:
            raise
        return None
    return admitted_community(request, _stored_admission(*answer[0][:_ADMISSION])), answer


def _claim_admitted(
    request: RequestEvent,
    params: dict[str, object],
    statement: statements.Statement,
    lease_seconds: int | None,
    using: str,
) -> tuple[UUID, list[Claimed]]:
    params["lease_seconds"] = checked_lease_seconds(lease_seconds)
    # A claim never refuses: a miss is a row of admission alone.
    community_id, answer = _run_admitted(request, statement, params, using)  # type: ignore[misc]
    pubkey = params["pubkey"]
    claimed = [
        found
        for row in answer
        if (found := _claimed(community_id, pubkey, row[_ADMISSION:])) is not None  # type: ignore[arg-type]
    ]
    # UPDATE … RETURNING has no order of its own; hand the rows out as picked.
    claimed.sort(key=lambda item: (item.record.created_at, item.record.id))
    return community_id, claimed


def claim_admitted(
    request: RequestEvent,
    *,
    delivery_id: UUID | str | None = None,
    expected: DeliveryBinding | None = None,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[UUID, Claimed | None]:
    """Admit ``request`` and claim, as ``claim_delivery`` does for the signing key (its
    oldest claimable delivery, or exactly ``delivery_id``, or only one matching
    ``expected``), in one statement: the community and the claim with its message,
    or None on a miss."""
    params = _admission_params(request)
    params["limit"] = 1
    if delivery_id is not None:
        delivery_id = as_uuid("delivery_id", delivery_id)
    statement = _claim_statement(params, delivery_id, _expected_binding(expected), _SERVED_CLAIMS)
    community_id, claimed = _claim_admitted(request, params, statement, lease_seconds, using)
    return community_id, (claimed[0] if claimed else None)


def claim_batch_admitted(
    request: RequestEvent,
    *,
    limit: int,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[UUID, list[Claimed]]:
    """Admit ``request`` and claim up to ``limit`` of the signing key's oldest
    claimable deliveries, as ``claim_deliveries`` does, each with its message, in one
    statement: the community and the claims, oldest first."""
    if not is_whole_number(limit) or not 1 <= limit <= MAX_BATCH_SIZE:
        raise ProtocolError(
            "limit", f"must be a whole number from 1 to {MAX_BATCH_SIZE}, not {limit!r}"
        )
    params = _admission_params(request)
    params["limit"] = limit
    return _claim_admitted(request, params, statements.SERVED_CLAIM, lease_seconds, using)


def _admitted_lease_params(
    request: RequestEvent, delivery_id: UUID | str, generation: int
) -> dict[str, object]:
    """An admitting statement's parameters for the signing key's lease on
    ``delivery_id`` at ``generation`` (checked as a ``Lease`` checks them)."""
    params = _admission_params(request)
    lease = Lease(
        community_id=UUID(int=0),
        delivery_id=as_uuid("delivery_id", delivery_id),
        target_pubkey=params["pubkey"],  # type: ignore[arg-type]
        generation=generation,
        lease_until=_NO_TIME,
    )
    params.update(delivery_id=lease.delivery_id, generation=lease.generation)
    return params


def renew_admitted(
    request: RequestEvent,
    delivery_id: UUID | str,
    generation: int,
    *,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Renewed | LeaseLost:
    """Admit ``request`` and renew the signing key's lease (``delivery_id`` at
    ``generation``) as ``renew_delivery`` does, in one statement; a lost lease keeps
    nothing of the request."""
    params = _admitted_lease_params(request, delivery_id, generation)
    params["lease_seconds"] = checked_lease_seconds(lease_seconds)
    answered = _run_admitted(request, statements.SERVED_RENEW, params, using)
    if answered is None:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    return Renewed(lease_until=answered[1][0][_ADMISSION])


def finish_admitted(
    request: RequestEvent,
    delivery_id: UUID | str,
    generation: int,
    outcome: Outcome | str,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> Settled | AlreadyTerminal | LeaseLost:
    """Admit ``request`` and settle the signing key's lease (``delivery_id`` at
    ``generation``) once, as ``finish_delivery`` does, in one statement; a lost lease
    keeps nothing of the request."""
    params = _admitted_lease_params(request, delivery_id, generation)
    outcome = _checked_outcome(outcome)
    params["outcome"] = outcome.value
    answered = _run_admitted(request, statements.SERVED_FINISH, params, using)
    if answered is None:
        return _settle_result(outcome, None, None)
    settled, seen = answered[1][0][_ADMISSION : _ADMISSION + 2]
    return _settle_result(outcome, settled, seen)


def claim_enrolled(
    community_id: UUID | str,
    target_pubkey: bytes,
    *,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Claimed | None:
    """For a request admitted earlier (a claim that waited): the key's oldest
    claimable delivery with its message, claimed only while the key is an enabled
    agent of the community (a revocation meanwhile claims nothing). None on a miss."""
    community_id = as_uuid("community_id", community_id)
    target_pubkey = as_bytes32("target_pubkey", target_pubkey)
    params = {
        "community_id": community_id,
        "target_pubkey": target_pubkey,
        "lease_seconds": checked_lease_seconds(lease_seconds),
    }
    answer = run.fetch(using, statements.CLAIM_ENROLLED, params)
    return _claimed(community_id, target_pubkey, answer[0]) if answer else None


def finish_and_claim_next_admitted(
    request: RequestEvent,
    delivery_id: UUID | str,
    generation: int,
    outcome: Outcome | str,
    *,
    lease_seconds: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> FinishedAndNext:
    """Admit ``request`` and settle the signing key's lease (``delivery_id`` at
    ``generation``) and claim the key's oldest claimable delivery with its message
    (``FinishedAndNext.next`` a ``Claimed``), in one statement, as
    ``finish_and_claim_next`` does; a lost lease keeps nothing of the request."""
    params = _admitted_lease_params(request, delivery_id, generation)
    outcome = _checked_outcome(outcome)
    params.update(outcome=outcome.value, lease_seconds=checked_lease_seconds(lease_seconds))
    answered = _run_admitted(request, statements.SERVED_FINISH_AND_CLAIM_NEXT, params, using)
    if answered is None:
        return FinishedAndNext(result=_settle_result(outcome, None, None))
    community_id, answer = answered
    row = answer[0]
    result = _settle_result(outcome, row[_ADMISSION], row[_ADMISSION + 1])
    if not isinstance(result, Settled):
        return FinishedAndNext(result=result)
    claimed = _claimed(community_id, params["pubkey"], row[_ADMISSION + 3 :])  # type: ignore[arg-type]
    return FinishedAndNext(result=result, next=claimed)
