"""The signed HTTP API's request guard: admit a request event (the host's community,
the caller's standing in its roster, the freshness window) and record it once, so a
replayed request is refused; the refusal an admission calls for; and the prune of
guard rows past the window."""

from __future__ import annotations

import logging
import threading
import time
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..conf import app_settings
from ..exceptions import (
    AgentAuthRefused,
    CommunityDeleting,
    CommunityNotServed,
    CommunityWriteFenced,
    ProtocolError,
)
from ..protocol import AgentStanding, RequestAdmission, RequestEvent, as_bytes32
from ..store import run, statements
from ..validation import checked_batch_size, is_whole_number

logger = logging.getLogger(__name__)


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
    where ``pubkey`` stands in its agent roster, with the freshness check (by the
    database clock) and the replay guard, in one statement. Only an enabled agent's
    fresh event is recorded, and once, whatever the community: a second arrival (from
    any process, at the same instant, for any community) is ``recorded=False``. In the
    caller's transaction the replay row commits or rolls back with the caller's work,
    and the roster's shared lock is held until then (a revocation of the key waits for
    the request); an unknown host records nothing."""
    if not isinstance(host, str) or not host:
        raise ProtocolError("host", f"must be a host name, not {host!r}")
    event_id, created_at = _request_event(event_id, created_at)
    pubkey = as_bytes32("pubkey", pubkey)
    skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
    params = {
        "created_at": created_at,
        "skew": skew,
        "host": host,
        "pubkey": pubkey,
        "event_id": event_id,
    }
    (row,) = run.fetch(using, statements.ADMIT_REQUEST_EVENT, params, savepoint=False)
    return _stored_admission(*row)


def admit(request: RequestEvent, *, using: str = DEFAULT_DB_ALIAS) -> UUID:
    """The community ``request`` is admitted to (``admit_request_event``), or the
    refusal its admission calls for (``admitted_community``)."""
    if not isinstance(request, RequestEvent):
        raise ProtocolError("request", f"must be a RequestEvent, not {type(request).__name__}")
    admission = admit_request_event(
        request.host, request.event_id, request.created_at, pubkey=request.pubkey, using=using
    )
    return admitted_community(request, admission)


def admitted_community(request: RequestEvent, admission: RequestAdmission) -> UUID:
    """The community of an admission that admitted ``request``, or the refusal it
    calls for: ``CommunityNotServed`` (no community at the host), ``CommunityDeleting``,
    or ``AgentAuthRefused`` (``auth_stale``, ``auth_unknown_agent``, ``auth_revoked``,
    ``auth_replay``)."""
    if admission.community_id is None:
        raise CommunityNotServed(request.host)
    if admission.deleting:
        raise CommunityDeleting(admission.community_id)
    if not admission.fresh:
        skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
        raise AgentAuthRefused(
            "auth_stale", f"created_at must be within {skew} s of the server's clock"
        )
    key = bytes(request.pubkey).hex()
    if admission.standing is None:
        raise AgentAuthRefused(
            "auth_unknown_agent", f"the key {key} is not an agent of this community"
        )
    if admission.standing is AgentStanding.REVOKED:
        raise AgentAuthRefused(
            "auth_revoked", f"the key {key} was revoked from this community's agents"
        )
    if not admission.recorded:
        raise AgentAuthRefused("auth_replay", "this signed request was already used")
    return admission.community_id


def _admission_params(request: RequestEvent) -> dict[str, object]:
    """The parameters of a statement that admits ``request`` (``statements.api._admitted``):
    the freshness window, the host, the key, the event's id and time, each checked."""
    if not isinstance(request, RequestEvent):
        raise ProtocolError("request", f"must be a RequestEvent, not {type(request).__name__}")
    if not isinstance(request.host, str) or not request.host:
        raise ProtocolError("host", f"must be a host name, not {request.host!r}")
    event_id, created_at = _request_event(request.event_id, request.created_at)
    return {
        "created_at": created_at,
        "skew": app_settings.API_MAX_CLOCK_SKEW_SECONDS,
        "host": request.host,
        "pubkey": as_bytes32("pubkey", request.pubkey),
        "event_id": event_id,
    }


def _stored_admission(
    community_id: UUID | None, fresh: bool, recorded: bool, standing: str | None
) -> RequestAdmission:
    """The admission columns every admitting statement answers first."""
    deleting = standing == statements.ADMISSION_DELETING
    return RequestAdmission(
        community_id=community_id,
        fresh=bool(fresh),
        recorded=bool(recorded),
        standing=None if standing is None or deleting else AgentStanding(standing),
        deleting=deleting,
    )


def prune_replay_guard(
    *, batch_size: int = 1000, max_batches: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Delete the replay-guard rows whose events can no longer pass the freshness
    window (kept one extra window, so a request checked just before a prune cannot
    slip past its twin), in bounded batches; returns how many were deleted. A
    community being deleted is skipped, not waited for."""
    checked_batch_size(batch_size)
    horizon = 2 * app_settings.API_MAX_CLOCK_SKEW_SECONDS
    total, batches = 0, 0
    while max_batches is None or batches < max_batches:
        # Each batch is its own short transaction (unless the caller holds one).
        try:
            params = {"horizon": horizon, "limit": batch_size}
            count = run.fetch_count(using, statements.PRUNE_REPLAYS_BATCH, params)
        except CommunityWriteFenced:
            # A tenant was fenced between our look at it and the delete; the next
            # sweep skips it.
            return total
        total += count
        batches += 1
        if count < batch_size:
            break
    return total


_prune_lock = threading.Lock()
_pruned_at = time.monotonic()


def prune_replay_guard_now_and_then() -> None:
    """``prune_replay_guard`` from the request path: at most once per
    ``WORKFLOW_DELIVERY_API_REPLAY_PRUNE_INTERVAL_SECONDS`` per process, a bounded
    amount each time, outside the request's transaction."""
    global _pruned_at
    interval = app_settings.API_REPLAY_PRUNE_INTERVAL_SECONDS
    if time.monotonic() - _pruned_at < interval or not _prune_lock.acquire(blocking=False):
        return
    try:
        _pruned_at = time.monotonic()
        deleted = prune_replay_guard(max_batches=4)
        logger.debug("replay guard: pruned %s rows", deleted)
    finally:
        _prune_lock.release()
