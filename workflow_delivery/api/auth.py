"""Who is calling: the community named by the Host header and the key that signed
the request (NIP-98). Every refusal is an ``ApiError`` or ``AgentAuthRefused`` with a
stable code; the views never see an unauthenticated request."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpRequest
from django.http.request import split_domain_port
from ninja.security import APIKeyHeader

from .. import services
from ..conf import app_settings
from ..exceptions import AgentAuthRefused
from ..protocol import AgentStanding, RequestAdmission
from . import nip98
from .asgi import on_pooled_thread

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An answer other than a result: HTTP ``status``, stable ``code``, ``detail``."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        field: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        self.retry_after = retry_after
        super().__init__(f"{code}: {detail}")


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request: its community and the agent key that signed it."""

    community_id: UUID
    pubkey: bytes
    event_id: bytes


def request_host(request: HttpRequest) -> str:
    """The domain of the request's Host (no port): the community it is for."""
    domain, _port = split_domain_port(request.get_host())
    return domain


def request_body(request: HttpRequest) -> bytes:
    """The body, refused before it is read when it is larger than the API accepts."""
    limit = app_settings.API_MAX_BODY_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise ApiError(400, "invalid_request", "Content-Length is not a number") from None
    if declared > limit:
        raise ApiError(413, "body_too_large", f"the body must be at most {limit} bytes")
    body = request.body
    if len(body) > limit:
        raise ApiError(413, "body_too_large", f"the body must be at most {limit} bytes")
    return body


def served_url(request: HttpRequest) -> str:
    """The absolute URL this request was served at, as the signer must name it. Behind
    a proxy, ``WORKFLOW_DELIVERY_API_ORIGIN`` (e.g. ``https://agents.example``) is the
    scheme and host clients were given."""
    origin = app_settings.API_ORIGIN or f"{request.scheme}://{request.get_host()}"
    return origin.rstrip("/") + request.get_full_path()


@dataclass(frozen=True, slots=True)
class Signed:
    """A request whose signature and NIP-98 binding hold, not yet admitted: the host
    it is for, its event and the key that signed it."""

    host: str
    event: nip98.SignedEvent
    pubkey: bytes


def verify(request: HttpRequest) -> Signed:
    """The checks that need no database: the body's size, the header's event, its
    binding to this request and host, its id and signature."""
    host = request_host(request)
    body = request_body(request)
    event = nip98.parse_authorization(request.headers.get("Authorization"))
    nip98.check_request(event, url=served_url(request), method=request.method or "", body=body)
    # Behind a shared origin the signed URL names no community: the event must.
    nip98.check_host(event, host, required=bool(app_settings.API_ORIGIN))
    return Signed(host=host, event=event, pubkey=nip98.verify_event(event))


def authenticate(request: HttpRequest) -> Caller:
    """The caller of a signed request, or a refusal. Called inside the request's
    transaction (``views.in_one_transaction``), so the replay row it records
    commits with the operation or not at all."""
    signed = verify(request)
    community_id = admit(signed.host, signed.event, signed.pubkey)
    return Caller(community_id=community_id, pubkey=signed.pubkey, event_id=signed.event.id)


def admit(host: str, event: nip98.SignedEvent, pubkey: bytes) -> UUID:
    """The community served at ``host``, once ``pubkey`` is an enabled agent of its
    roster and the event is fresh and used for the first time anywhere (one
    statement: the look-ups, the clock, the replay guard)."""
    admission = services.admit_request_event(host, event.id, event.created_at, pubkey=pubkey)
    return admitted(host, pubkey, admission)


# Seconds a request of a community being deleted is told to wait (Retry-After).
COMMUNITY_DELETING_RETRY_AFTER = 5


def admitted(host: str, pubkey: bytes, admission: RequestAdmission) -> UUID:
    """The admission's community, or the refusal it calls for."""
    if admission.community_id is None:
        raise ApiError(404, "unknown_community", f"no community is served at host {host!r}")
    if admission.deleting:
        raise ApiError(
            503,
            "community_deleting",
            "the community is being deleted; try again later",
            retry_after=COMMUNITY_DELETING_RETRY_AFTER,
        )
    if not admission.fresh:
        skew = app_settings.API_MAX_CLOCK_SKEW_SECONDS
        raise AgentAuthRefused(
            "auth_stale", f"created_at must be within {skew} s of the server's clock"
        )
    if admission.standing is None:
        raise AgentAuthRefused(
            "auth_unknown_agent", f"the key {pubkey.hex()} is not an agent of this community"
        )
    if admission.standing is AgentStanding.REVOKED:
        raise AgentAuthRefused(
            "auth_revoked", f"the key {pubkey.hex()} was revoked from this community's agents"
        )
    if not admission.recorded:
        raise AgentAuthRefused("auth_replay", "this signed request was already used")
    return admission.community_id


_prune_lock = threading.Lock()
_pruned_at = time.monotonic()


def prune_now_and_then() -> None:
    """Prune the replay guard from the request path at most once per interval per
    process, a bounded amount each time, outside the request's transaction; the
    reaper's loop may also call it."""
    global _pruned_at
    interval = app_settings.API_REPLAY_PRUNE_INTERVAL_SECONDS
    if time.monotonic() - _pruned_at < interval or not _prune_lock.acquire(blocking=False):
        return
    try:
        _pruned_at = time.monotonic()
        deleted = services.prune_replay_guard(max_batches=4)
        logger.debug("replay guard: pruned %s rows", deleted)
    finally:
        _prune_lock.release()


class NostrAuth(APIKeyHeader):
    """django-ninja's hook (and the OpenAPI security scheme) for NIP-98."""

    param_name = "Authorization"

    def authenticate(self, request: HttpRequest, key: str | None) -> Caller:
        return authenticate(request)


class NostrSignedAuth(NostrAuth):
    """NIP-98 for a view that admits its request in the statement that serves it
    (``served``): the checks that need no database; ``request.auth`` is ``Signed``."""

    def authenticate(self, request: HttpRequest, key: str | None) -> Signed:  # type: ignore[override]
        return verify(request)


# Waits are many and long, their database work short: this bounds how many waits of
# one process use a connection at once, so a crowd of waiters can never take all of
# the server's connections (claims, renews and finishes are not gated).
wait_gate = threading.BoundedSemaphore(4)


def release_connection() -> None:
    """Close this thread's connection unless a transaction holds it: a waiting request
    needs none while it waits (CONN_MAX_AGE would otherwise keep it until the end).
    A pooled thread's connection stays: the thread's other requests use it
    (``asgi.PooledThreadsHandler``), and there are only so many such threads."""
    connection = connections[DEFAULT_DB_ALIAS]
    if not connection.in_atomic_block and not on_pooled_thread():
        connection.close()


class NostrWaitAuth(NostrAuth):
    """NIP-98 for ``wait``: the same checks, through the wait gate, and the
    connection released before the request starts waiting."""

    def authenticate(self, request: HttpRequest, key: str | None) -> Caller:
        with wait_gate:
            try:
                # In autocommit: the wait holds no transaction while it waits.
                caller = authenticate(request)
                prune_now_and_then()
                return caller
            finally:
                release_connection()
