"""The agent HTTP API: claim, renew, finish, read and wait, each scoped to the key
that signed the request, in the community named by the Host header.

Results map to answers; everything else is ``{"error": code, "detail": text}`` with a
stable code. The OpenAPI 3 document is derived from these views by django-ninja.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from uuid import UUID

from asgiref.sync import sync_to_async
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Query, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError

from .. import services
from ..conf import app_settings
from ..exceptions import AgentAuthRefused, CommunityWriteFenced, ProtocolError
from ..models import WorkflowAgentDelivery
from ..protocol import AlreadyTerminal, Lease, LeaseLost, Renewed, as_uuid
from . import documents, schema
from .auth import ApiError, Caller, NostrAuth, NostrWaitAuth, release_connection, wait_gate
from .wake import hub

api = NinjaAPI(
    title="Workflow delivery: agent API",
    version="1",
    description=(
        "Signed-request API for managed agents. Every request carries "
        "`Authorization: Nostr <base64 NIP-98 event>` signed by the agent's key; the "
        "community is the one whose host is the request's Host header."
    ),
    urls_namespace="workflow_delivery_api",
    openapi_url="v1/openapi.json",
    docs_url=None,
    auth=NostrAuth(),
)

ERRORS = {code: schema.ErrorOut for code in (400, 401, 404, 409, 413)}


def error(
    request: HttpRequest, status: int, code: str, detail: str, field: str | None = None
) -> HttpResponse:
    body: dict[str, str] = {"error": code, "detail": detail}
    if field is not None:
        body["field"] = field
    return api.create_response(request, body, status=status)


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return error(request, exc.status, exc.code, exc.detail, exc.field)


@api.exception_handler(AgentAuthRefused)
def _refused(request: HttpRequest, exc: AgentAuthRefused) -> HttpResponse:
    return error(request, 401, exc.code, exc.detail)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return error(request, 401, "auth_missing", "send Authorization: Nostr <base64 signed event>")


@api.exception_handler(CommunityWriteFenced)
def _fenced(request: HttpRequest, exc: CommunityWriteFenced) -> HttpResponse:
    return error(request, 409, "community_fenced", "the community is not accepting writes")


@api.exception_handler(ProtocolError)
def _protocol(request: HttpRequest, exc: ProtocolError) -> HttpResponse:
    return error(request, 400, "invalid_request", str(exc), exc.field)


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    first = exc.errors[0] if exc.errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "payload")]
    field = ".".join(location) or None
    detail = f"{field}: {first.get('msg', 'invalid')}" if field else first.get("msg", "invalid")
    return error(request, 400, "invalid_request", detail, field)


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400 and str(exc).startswith("Cannot parse request body"):
        return error(request, 400, "invalid_json", "the body is not a JSON document")
    return error(request, exc.status_code, "http_error", str(exc))


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return error(request, 404, "not_found", "no such delivery for this agent")


def _lease_lost(request: HttpRequest) -> HttpResponse:
    return error(
        request, 409, "lease_lost", "the lease is expired, reaped, superseded or not yours"
    )


def _caller(request: HttpRequest) -> Caller:
    return request.auth  # type: ignore[attr-defined,return-value]


def _delivery_id(value: str) -> UUID:
    try:
        return as_uuid("delivery_id", value)
    except ProtocolError as exc:
        raise ApiError(400, "invalid_request", str(exc), "delivery_id") from None


def _lease(caller: Caller, delivery_id: str, generation: int) -> Lease:
    # The database judges expiry by its own clock; a lease's lease_until is never read.
    return Lease(
        community_id=caller.community_id,
        delivery_id=_delivery_id(delivery_id),
        target_pubkey=caller.pubkey,
        generation=generation,
        lease_until=datetime.min.replace(tzinfo=UTC),
    )


@api.post(
    "v1/claim",
    response={200: schema.ClaimOut, 204: None, **ERRORS},
    summary="Claim the caller's oldest pending delivery (or the one named)",
)
def claim(request: HttpRequest, payload: schema.ClaimIn | None = None):
    caller = _caller(request)
    payload = payload or schema.ClaimIn()
    claimed = services.claim_delivery(
        caller.community_id,
        caller.pubkey,
        delivery_id=payload.delivery_id,
        expected=payload.expected.binding() if payload.expected is not None else None,
        lease_seconds=payload.lease_seconds,
    )
    if claimed is None:
        return Status(204, None)
    lease, record = claimed
    return Status(
        200,
        {
            "lease": documents.lease_document(lease),
            "delivery": documents.delivery_document(record),
        },
    )


@api.post(
    "v1/deliveries/{delivery_id}/renew",
    response={200: schema.RenewOut, **ERRORS},
    summary="Extend a live lease",
)
def renew(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.RenewIn):
    lease = _lease(_caller(request), delivery_id, payload.generation)
    result = services.renew_delivery(lease, lease_seconds=payload.lease_seconds)
    if isinstance(result, Renewed):
        return Status(200, {"lease_until": documents.instant(result.lease_until)})
    return _lease_lost(request)


@api.post(
    "v1/deliveries/{delivery_id}/finish",
    response={200: schema.FinishOut, **ERRORS},
    summary="Settle a claimed delivery once",
)
def finish(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.FinishIn):
    lease = _lease(_caller(request), delivery_id, payload.generation)
    result = services.finish_delivery(lease, payload.outcome)
    if isinstance(result, LeaseLost):
        return _lease_lost(request)
    if isinstance(result, AlreadyTerminal):
        return Status(200, {"result": "already_terminal", "status": result.status.value})
    return Status(200, {"result": "settled", "outcome": result.outcome.value})


@api.get(
    "v1/deliveries/{delivery_id}",
    response={200: schema.DeliveryOut, **ERRORS},
    summary="Read one of the caller's deliveries",
)
def get(request: HttpRequest, delivery_id: schema.Uuid):
    caller = _caller(request)
    record = services.get_delivery(caller.community_id, _delivery_id(delivery_id))
    if record is None or record.binding.target_pubkey != caller.pubkey:
        # Another agent's delivery answers exactly as a missing one.
        raise Http404
    return Status(200, documents.delivery_document(record))


def _prepare_wait(caller: Caller) -> UUID | None:
    """After the waiter is registered and, with wake-ups on, the listener LISTENs: the
    oldest pending delivery already there (committed before we listened), or None.
    With them off nothing is sent to listen for; the wait polls instead."""
    if app_settings.NOTIFY:
        hub.ensure_listening()
    return _pending_delivery(caller)


def _pending_delivery(caller: Caller) -> UUID | None:
    """The caller's oldest claimable delivery (pending and not backing off after a
    retry), or None. The request's connection is then released so the wait itself
    holds none."""
    with wait_gate:
        try:
            return (
                WorkflowAgentDelivery.objects.claimable()
                .for_target(caller.community_id, caller.pubkey)
                .order_by("created_at", "id")
                .values_list("id", flat=True)
                .first()
            )
        finally:
            release_connection()


def _wake(caller: Caller, delivery_id: UUID) -> Status:
    return Status(200, {"delivery_id": str(delivery_id), "target": caller.pubkey.hex()})


@api.get(
    "v1/wait",
    response={200: schema.WakeOut, 204: None, **ERRORS, 503: schema.ErrorOut},
    summary="Wait until one of the caller's deliveries is committed",
    auth=NostrWaitAuth(),
)
async def wait(
    request: HttpRequest,
    timeout: int = Query(30, ge=0, le=60, description="seconds to wait at most (0-60)"),
):
    caller = _caller(request)
    timeout = min(timeout, app_settings.API_MAX_WAIT_SECONDS)
    if hub.waiting >= app_settings.API_MAX_WAITERS:
        return error(request, 503, "too_many_waiters", "this server has enough waiters; poll")
    waiter = hub.register(caller.community_id, caller.pubkey)
    try:
        pending = await sync_to_async(_prepare_wait)(caller)
        if pending is not None:
            return _wake(caller, pending)
        delivery_id = await _until_woken(caller, waiter.future, timeout)
        if delivery_id is None:
            return Status(204, None)
        return _wake(caller, delivery_id)
    finally:
        hub.unregister(caller.community_id, caller.pubkey, waiter)


async def _until_woken(
    caller: Caller, woken: asyncio.Future[UUID | None], timeout: float
) -> UUID | None:
    """The delivery a wake-up names, or None at the timeout (or after the listener
    lost its session). With ``WORKFLOW_DELIVERY_NOTIFY`` off this process's producers
    send no wake-ups, so the caller's pending deliveries are also looked for every
    ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    poll = None if app_settings.NOTIFY else app_settings.API_WAIT_POLL_SECONDS
    while (remaining := deadline - loop.time()) > 0:
        # asyncio.wait, not wait_for: a slice that ends must not cancel the future.
        done, _ = await asyncio.wait({woken}, timeout=min(remaining, poll or remaining))
        if done:
            return woken.result()
        if poll is not None and (pending := await sync_to_async(_pending_delivery)(caller)):
            return pending
    return None
