"""Claim, renew and finish, each admitted and served by one statement.

The statement (``store.statements.SERVED_CLAIM``, ``SERVED_RENEW``, ``SERVED_FINISH``) looks up
the community of the request's host and where the signing key stands in its roster,
checks the event's freshness, records it in the replay guard, runs the operation on
that community only if the event was recorded, and for a claim reads the claimed
delivery's message: one round trip, in autocommit, so the statement is the request's
transaction. The replay row commits with the operation or not at all; an operation
that refuses (a lost lease) raises inside the statement, which rolls back the row
too, so an honest retry is judged afresh. A replayed event records nothing and the
operation does not run.

Inside a transaction the caller already holds (``ATOMIC_REQUESTS``) the statement
runs under a savepoint of its own instead, with the same effect.
"""

from __future__ import annotations

import select
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections

from .. import counters
from ..conf import app_settings
from ..exceptions import ConstraintViolation
from ..protocol import (
    AgentStanding,
    AlreadyTerminal,
    DeliveryRecord,
    DeliveryStatus,
    Lease,
    LeaseLost,
    MessageEvent,
    Outcome,
    Renewed,
    RequestAdmission,
    Settled,
    stored_lease,
    stored_message,
)
from ..services.holder import checked_lease_seconds
from ..store import rows, run, statements
from ..store.errors import REQUEST_REFUSED
from ..store.statement import Statement
from .auth import Signed, admitted

_RECORD = len(rows.RECORD_COLUMNS)
_ADMISSION = 4


class _Refused(Exception):
    """The statement's operation refused (``wd_refuse_request``)."""


def _usable(raw: Any) -> bool:
    """Whether an idle connection can take a statement, judged without a round trip:
    not closed or broken, and nothing waiting to be read on its socket (an idle
    session in autocommit is sent nothing unasked, so anything readable is the end
    of the session: the server's goodbye or the socket's EOF)."""
    if getattr(raw, "closed", True) or getattr(raw, "broken", False):
        return False
    try:
        readable, _, _ = select.select([raw.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def check_connection(using: str = DEFAULT_DB_ALIAS) -> None:
    """Django's per-request health check (``CONN_HEALTH_CHECKS``) made without its
    ``SELECT 1``: a reused connection found unusable is closed, and the next
    statement opens a new one. Before a transaction begins, so a dead session is
    never the one its BEGIN is sent on."""
    wrapper = connections[using]
    if not wrapper.health_check_enabled or wrapper.health_check_done:
        return
    raw = wrapper.connection
    if raw is not None and not wrapper.in_atomic_block and not _usable(raw):
        wrapper.close()
    wrapper.health_check_done = True


def _run(
    signed: Signed, statement: Statement, params: dict[str, object]
) -> tuple[UUID, list[tuple]]:
    """The statement's rows once the request is admitted (else its refusal)."""
    event = signed.event
    skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
    params.update(
        created_at=event.created_at,
        skew=skew,
        host=signed.host,
        pubkey=signed.pubkey,
        event_id=event.id,
    )
    check_connection()
    try:
        answer = run.fetch(DEFAULT_DB_ALIAS, statement, params)
    except ConstraintViolation as exc:
        if exc.constraint == REQUEST_REFUSED:
            raise _Refused from exc
        raise
    community_id, fresh, recorded, standing = answer[0][:_ADMISSION]
    deleting = standing == statements.ADMISSION_DELETING
    found = RequestAdmission(
        community_id=community_id,
        fresh=bool(fresh),
        recorded=bool(recorded),
        standing=None if standing is None or deleting else AgentStanding(standing),
        deleting=deleting,
    )
    return admitted(signed.host, signed.pubkey, found), answer


def _message(columns: tuple) -> MessageEvent | None:
    # The event's columns are NULL when the claimed delivery's event is not stored.
    return None if columns[0] is None else stored_message(*columns)


def claim(
    signed: Signed, *, limit: int, lease_seconds: int | None
) -> list[tuple[Lease, DeliveryRecord, MessageEvent | None]]:
    """Claim up to ``limit`` of the caller's oldest claimable deliveries, oldest first,
    each with its lease and message."""
    seconds = checked_lease_seconds(lease_seconds)
    community_id, answer = _run(
        signed, statements.SERVED_CLAIM, {"limit": limit, "lease_seconds": seconds}
    )
    claimed = []
    for row in answer:
        if row[_ADMISSION] is None:
            continue
        record = rows.record(row[_ADMISSION : _ADMISSION + _RECORD])
        message = _message(row[_ADMISSION + _RECORD :])
        claimed.append((stored_lease(community_id, signed.pubkey, record), record, message))
    # UPDATE … RETURNING has no order of its own; hand the rows out as picked.
    claimed.sort(key=lambda item: (item[1].created_at, item[1].id))
    counters.CLAIMS.inc(len(claimed))
    return claimed


def renew(
    signed: Signed, delivery_id: UUID, generation: int, lease_seconds: int | None
) -> Renewed | LeaseLost:
    """Extend the caller's live lease; a lost lease leaves nothing recorded."""
    seconds = checked_lease_seconds(lease_seconds)
    params = {"lease_seconds": seconds, "delivery_id": delivery_id, "generation": generation}
    try:
        _, answer = _run(signed, statements.SERVED_RENEW, params)
    except _Refused:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    return Renewed(lease_until=answer[0][_ADMISSION])


def finish(
    signed: Signed, delivery_id: UUID, generation: int, outcome: Outcome
) -> Settled | AlreadyTerminal | LeaseLost:
    """Settle the caller's lease once: what ``services.finish_delivery`` answers; a
    lost lease leaves nothing recorded."""
    params = {"outcome": outcome.value, "delivery_id": delivery_id, "generation": generation}
    try:
        _, answer = _run(signed, statements.SERVED_FINISH, params)
    except _Refused:
        counters.LEASES_LOST.inc()
        return LeaseLost()
    settled, seen = answer[0][_ADMISSION : _ADMISSION + 2]
    if settled is not None:
        counters.SETTLED[outcome.value].inc()
        return Settled(outcome=outcome)
    return AlreadyTerminal(status=DeliveryStatus(seen))
