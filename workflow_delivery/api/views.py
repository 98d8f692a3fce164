"""The agent HTTP API: claim, renew, finish (or fail with a reason, retry, release),
reply, read and wait, each scoped to the key that signed the request, in the
community named by the Host header.

Results map to answers; everything else is ``{"error": code, "detail": text}`` with a
stable code. The OpenAPI 3 document is derived from these views by django-ninja.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import wraps
from uuid import UUID

from asgiref.sync import async_to_sync, sync_to_async
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db import Error as DatabaseError
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Query, Status
from ninja.decorators import decorate_view
from ninja.errors import AuthenticationError, HttpError, ValidationError

from .. import services, wire
from ..conf import app_settings
from ..errors import is_connection_lost
from ..exceptions import (
    AgentAuthRefused,
    CommunityDeleting,
    CommunityNotServed,
    CommunityWriteFenced,
    LeaseNotLive,
    ProtocolError,
    TargetNotEnrolled,
)
from ..models import WorkflowAgentDelivery
from ..protocol import (
    AlreadyTerminal,
    Claimed,
    DeliveryRecord,
    Exhausted,
    Lease,
    LeaseLost,
    MessageEvent,
    Outcome,
    Renewed,
    Settled,
    as_uuid,
)
from ..store.run import one_transaction
from ..validation import AGENT_TURN_TEXT_MAX_BYTES
from . import schema
from .asgi import Parked, parking_loop
from .auth import ApiError, NostrAuth, Signed, request_event
from .connection import check_connection, waiting_work
from .wake import Waiter, hub


class _DocumentedOnce(NinjaAPI):
    """The OpenAPI document built once per process for each path it is served under
    (building it costs tens of milliseconds, and ``openapi.json`` and ``v1/docs``
    answer without a signature). The views and their schemas are fixed at import."""

    def get_openapi_schema(self, *, path_prefix=None, path_params=None):  # type: ignore[override]
        if path_prefix is None:
            path_prefix = self.get_root_path(path_params or {})
        built = self._documents.get(path_prefix)
        if built is None:
            built = self._documents[path_prefix] = super().get_openapi_schema(
                path_prefix=path_prefix
            )
        return built

    @property
    def _documents(self) -> dict:
        return self.__dict__.setdefault("_openapi_documents", {})


api = _DocumentedOnce(
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

ERRORS = {code: schema.ErrorOut for code in (400, 401, 404, 409, 413, 503)}


def error(
    request: HttpRequest, status: int, code: str, detail: str, field: str | None = None
) -> HttpResponse:
    body: dict[str, str] = {"error": code, "detail": detail}
    if field is not None:
        body["field"] = field
    return api.create_response(request, body, status=status)


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    response = error(request, exc.status, exc.code, exc.detail, exc.field)
    if exc.retry_after is not None:
        response["Retry-After"] = str(exc.retry_after)
    return response


@api.exception_handler(AgentAuthRefused)
def _refused(request: HttpRequest, exc: AgentAuthRefused) -> HttpResponse:
    return error(request, 401, exc.code, exc.detail)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return error(request, 401, "auth_missing", "send Authorization: Nostr <base64 signed event>")


# Seconds a request of a community being deleted is told to wait (Retry-After).
COMMUNITY_DELETING_RETRY_AFTER = 5


@api.exception_handler(CommunityNotServed)
def _unknown_community(request: HttpRequest, exc: CommunityNotServed) -> HttpResponse:
    return error(request, 404, "unknown_community", str(exc))


@api.exception_handler(CommunityDeleting)
def _deleting(request: HttpRequest, exc: CommunityDeleting) -> HttpResponse:
    response = error(request, 503, "community_deleting", str(exc))
    response["Retry-After"] = str(COMMUNITY_DELETING_RETRY_AFTER)
    return response


# Seconds a request is told to wait when the database could not be reached: about
# one attempt of a multi-host connection string while a standby is being promoted.
DATABASE_UNAVAILABLE_RETRY_AFTER = 2


@api.exception_handler(DatabaseError)
def _database_unavailable(request: HttpRequest, exc: DatabaseError) -> HttpResponse:
    """A session lost or never opened (the server down, restarting, failing over)
    is answered as retryable; a transaction it cut short was rolled back or its
    outcome is unknown, and a retry of a finish converges either way. Any other
    database error is not the client's to retry, and stays a server error."""
    if not is_connection_lost(exc):
        raise exc
    response = error(request, 503, "database_unavailable", "the database cannot be reached now")
    response["Retry-After"] = str(DATABASE_UNAVAILABLE_RETRY_AFTER)
    return response


@api.exception_handler(CommunityWriteFenced)
def _fenced(request: HttpRequest, exc: CommunityWriteFenced) -> HttpResponse:
    return error(request, 409, "community_fenced", "the community is not accepting writes")


@api.exception_handler(ProtocolError)
def _protocol(request: HttpRequest, exc: ProtocolError) -> HttpResponse:
    return error(request, 400, "invalid_request", str(exc), exc.field)


@api.exception_handler(TargetNotEnrolled)
def _not_enrolled(request: HttpRequest, exc: TargetNotEnrolled) -> HttpResponse:
    return error(request, 400, "target_not_enrolled", str(exc), "to")


@api.exception_handler(LeaseNotLive)
def _not_live(request: HttpRequest, exc: LeaseNotLive) -> HttpResponse:
    return _lease_lost(request)


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


def in_one_transaction(run: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Authentication and operation in one transaction: the Host's community, the
    replay-guard row and the operation commit together, once. Any refusal (an
    answer of 400 or more) rolls it all back, so the event of a refused request is
    not kept and an honest retry is judged afresh; a replay of an accepted event
    waits on its row and is refused."""

    @wraps(run)
    def answer(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        check_connection()
        with one_transaction(DEFAULT_DB_ALIAS):
            response = run(request, *args, **kwargs)
            if response.status_code >= 400:
                transaction.set_rollback(True)
        services.prune_replay_guard_now_and_then()
        return response

    return answer


def _lease_lost(request: HttpRequest) -> HttpResponse:
    return error(
        request, 409, "lease_lost", "the lease is expired, reaped, superseded or not yours"
    )


@dataclass(frozen=True, slots=True)
class Caller:
    """An admitted request: its community and the agent key that signed it."""

    community_id: UUID
    pubkey: bytes
    event_id: bytes


def _caller(request: HttpRequest) -> Caller:
    """The signed request admitted by the services (``services.admit``: the Host's
    community, the key's standing, freshness, the replay guard), once per request.
    In the request's transaction (``in_one_transaction``), so the replay row commits
    with the operation or not at all."""
    caller = getattr(request, "_workflow_delivery_caller", None)
    if caller is None:
        signed = _signed(request)
        community_id = services.admit(request_event(signed))
        caller = Caller(community_id=community_id, pubkey=signed.pubkey, event_id=signed.event.id)
        request._workflow_delivery_caller = caller  # type: ignore[attr-defined]
    return caller


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


def _claimed(
    lease: Lease, record: DeliveryRecord, message: MessageEvent | None
) -> dict[str, object]:
    return {
        "lease": wire.lease_document(lease),
        "delivery": wire.delivery_document(record, message=message),
    }


def _signed(request: HttpRequest) -> Signed:
    return request.auth  # type: ignore[attr-defined,return-value]


def _answer(request: HttpRequest, document: dict) -> HttpResponse:
    """A 200 answer rendered as it is: the wire documents are the schema's already
    (``wire``; a test holds every answer to the schema its endpoint declares), so the
    response model is not run over them again."""
    return api.create_response(request, document, status=200)


def served_alone(run: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """For a view whose one statement admits its request and serves it (the services'
    ``*_admitted`` functions): no transaction around it, the connection checked
    before it, and the replay guard pruned now and then after it."""

    @wraps(run)
    def answer(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        check_connection()
        response = run(request, *args, **kwargs)
        services.prune_replay_guard_now_and_then()
        return response

    return answer


@api.post(
    "v1/claim",
    response={200: schema.ClaimOut, 204: None, **ERRORS, 503: schema.ErrorOut},
    summary="Claim the caller's oldest pending delivery (or the one named), waiting if asked",
)
def claim(request: HttpRequest, payload: schema.ClaimIn | None = None):
    signed = _signed(request)
    payload = payload or schema.ClaimIn()
    if payload.wait and (payload.delivery_id is not None or payload.expected is not None):
        raise ApiError(
            400, "invalid_request", "wait: only a claim of any delivery may wait", "wait"
        )
    if payload.wait:
        return _claim_waiting(request, signed, payload)
    return _claim_now(request, signed, payload)


def _claim_now(
    request: HttpRequest, signed: Signed, payload: schema.ClaimIn
) -> HttpResponse | Status:
    """The caller's oldest claimable delivery (or the one named, or one bound as
    expected), admitted, claimed and its message read in one statement."""
    try:
        check_connection()
        _, claimed = services.claim_admitted(
            request_event(signed),
            delivery_id=payload.delivery_id,
            expected=payload.expected.binding() if payload.expected is not None else None,
            lease_seconds=payload.lease_seconds,
        )
        if claimed is None:
            return Status(204, None)
        return _answer(request, _claimed(*claimed, claimed.message))
    finally:
        services.prune_replay_guard_now_and_then()


def _first_claim(
    request: HttpRequest, signed: Signed, lease_seconds: int | None
) -> tuple[UUID, Claimed | None]:
    """The waiting claim's admission and first claim, in one statement."""
    with waiting_work(request):
        community_id, claimed = services.claim_admitted(
            request_event(signed), lease_seconds=lease_seconds
        )
    services.prune_replay_guard_now_and_then()
    return community_id, claimed


@dataclass(slots=True)
class _WaitingClaim:
    """A waiting claim past its admission: who waits, until when, its request and
    its waiter."""

    request: HttpRequest
    community_id: UUID
    pubkey: bytes
    lease_seconds: int | None
    deadline: float
    loop: asyncio.AbstractEventLoop
    waiter: Waiter | None = None

    def look(self, *, looked: bool = False) -> Claimed | None:
        """A claim once this waiter is registered (a new one when it has none or it
        was woken), on the request's thread. Finding nothing while the process
        listens, the caller's target is registered as idle and claimed for once more,
        so a commit lands either before that claim or after the registration, which
        makes its producer notify; when this process registered it already and no
        notification has consumed it since (``WakeHub.registered``, asked once the
        waiter is registered), it stands and nothing more is asked. ``looked``: a
        claim was made just before (the admission's), so the first one here is left
        out."""
        if self.waiter is None or self.waiter.future.done():
            self.forget()
            self.waiter = hub.register(self.community_id, self.pubkey, loop=self.loop)
        listening = app_settings.NOTIFY is True and hub.ensure_listening()
        if not listening:
            hub.ensure_sweeping()
        if looked and (not listening or hub.registered(self.community_id, self.pubkey)):
            return None

        def claim() -> Claimed | None:
            return services.claim_enrolled(
                self.community_id, self.pubkey, lease_seconds=self.lease_seconds
            )

        def work() -> Claimed | None:
            # After a wake-up the request's Django part is over: the thread's session,
            # idle meanwhile, is checked as a request's first statement's is.
            check_connection()
            claimed = None if looked else claim()
            if claimed is not None or not listening:
                return claimed
            session = hub.session
            if session is None or hub.registered(self.community_id, self.pubkey):
                # No listening session to name yet: the hub wakes every waiter once it
                # has one, so nothing is registered meanwhile.
                return None
            hub.registering(self.community_id, self.pubkey)
            try:
                # The hub's session, not this request's: the request's connection may
                # be released while it waits, the hub's listens for the wake-up.
                services.register_idle(self.community_id, [self.pubkey], session=session)
            except BaseException:
                hub.forget_registration(self.community_id, self.pubkey)
                raise
            return claim()

        with waiting_work(self.request):
            claimed = work()
        if claimed is not None:
            self.forget()
        return claimed  # type: ignore[return-value]

    def forget(self) -> None:
        if self.waiter is not None:
            hub.unregister(self.community_id, self.pubkey, self.waiter)
            self.waiter = None


def _claim_waiting(request: HttpRequest, signed: Signed, payload: schema.ClaimIn) -> HttpResponse:
    """Claim now, or as soon as a delivery is claimable for the caller within
    ``payload.wait`` seconds: woken by the producers' notifications as ``wait`` is
    (and, with wake-ups off, by the process's poll of every waiter at once, every
    ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``),
    each wake-up followed by a claim that only an enabled agent's key can make.

    The admission, the first claim, the waiter's registration and the look after it
    run here, on the request's thread, in the one call that ran the middleware; the
    wait itself is ``Parked`` on the event loop (``api.asgi``), which takes the
    thread again only for the claim after a wake-up. Where no handler would resume a
    parked answer (Django's own path, WSGI), the wait runs here to its end."""
    seconds = payload.lease_seconds
    community_id, claimed = _first_claim(request, signed, seconds)
    if claimed is not None:
        return _answer(request, _claimed(*claimed, claimed.message))
    if hub.waiting >= app_settings.API_MAX_WAITERS:
        return error(request, 503, "too_many_waiters", "this server has enough waiters; poll")
    loop = parking_loop()
    if loop is None:
        return async_to_sync(_wait_inline)(request, community_id, signed.pubkey, payload)
    waiting = _WaitingClaim(
        request,
        community_id,
        signed.pubkey,
        seconds,
        deadline=time.monotonic() + min(payload.wait, app_settings.API_MAX_WAIT_SECONDS),
        loop=loop,
    )
    try:
        claimed = waiting.look(looked=True)
    except BaseException:
        waiting.forget()
        raise
    if claimed is not None:
        return _answer(request, _claimed(*claimed, claimed.message))
    return Parked(lambda: _until_claimed(request, waiting))


async def _wait_inline(
    request: HttpRequest, community_id: UUID, pubkey: bytes, payload: schema.ClaimIn
) -> HttpResponse:
    """The waiting claim where nothing resumes a parked answer: its look after the
    registration and its wait, on an event loop of asgiref's."""
    waiting = _WaitingClaim(
        request,
        community_id,
        pubkey,
        payload.lease_seconds,
        deadline=time.monotonic() + min(payload.wait, app_settings.API_MAX_WAIT_SECONDS),
        loop=asyncio.get_running_loop(),
    )
    try:
        claimed = await sync_to_async(waiting.look)(looked=True)
    except BaseException:
        waiting.forget()
        raise
    if claimed is not None:
        return _answer(request, _claimed(*claimed, claimed.message))
    return await _until_claimed(request, waiting)


async def _until_claimed(request: HttpRequest, waiting: _WaitingClaim) -> HttpResponse:
    """The parked waiting claim: a look after each wake-up (a notification, the safety
    poll, or with wake-ups off the process's poll, ``WakeHub.ensure_sweeping``) until
    one claims, or 204 at its deadline. Between looks it holds only its waiter's
    future."""
    try:
        while (remaining := waiting.deadline - time.monotonic()) > 0:
            woken = waiting.waiter.future if waiting.waiter is not None else None
            if woken is not None:
                # asyncio.wait, not wait_for: the deadline must not cancel it.
                await asyncio.wait({woken}, timeout=remaining)
                if not woken.done():
                    continue
            try:
                claimed = await sync_to_async(waiting.look)()
            except DatabaseError as exc:
                # Past the view: answered here as its exception handler would.
                return _database_unavailable(request, exc)
            if claimed is not None:
                return _answer(request, _claimed(*claimed, claimed.message))
    finally:
        waiting.forget()
    return HttpResponse(status=204)


@api.post(
    "v1/claim/batch",
    response={200: schema.ClaimBatchOut, **ERRORS},
    summary="Claim up to `limit` of the caller's oldest pending deliveries",
)
@decorate_view(served_alone)
def claim_batch(request: HttpRequest, payload: schema.ClaimBatchIn):
    _, claimed = services.claim_batch_admitted(
        request_event(_signed(request)), limit=payload.limit, lease_seconds=payload.lease_seconds
    )
    return _answer(request, {"claimed": [_claimed(*item, item.message) for item in claimed]})


@api.post(
    "v1/deliveries/{delivery_id}/renew",
    response={200: schema.RenewOut, **ERRORS},
    summary="Extend a live lease",
)
@decorate_view(served_alone)
def renew(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.RenewIn):
    result = services.renew_admitted(
        request_event(_signed(request)),
        _delivery_id(delivery_id),
        payload.generation,
        lease_seconds=payload.lease_seconds,
    )
    if isinstance(result, Renewed):
        return _answer(request, {"lease_until": wire.instant(result.lease_until)})
    return _lease_lost(request)


def _finish_document(result: Settled | AlreadyTerminal) -> dict[str, str]:
    if isinstance(result, AlreadyTerminal):
        return {"result": "already_terminal", "status": result.status.value}
    return {"result": "settled", "outcome": result.outcome.value}


@api.post(
    "v1/deliveries/{delivery_id}/finish",
    response={200: schema.FinishOut, **ERRORS},
    summary="Settle a claimed delivery once (and, with `next`, claim the next one)",
)
@decorate_view(served_alone)
def finish(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.FinishIn):
    if payload.error is not None and payload.outcome != Outcome.FAILED.value:
        raise ApiError(400, "invalid_request", "error: only with a failed outcome", "error")
    for name in ("error", "turn"):
        if getattr(payload, name) is not None and payload.next:
            raise ApiError(400, "invalid_request", f"{name}: not with next", name)
    if payload.next:
        return _finish_and_claim_next(request, _delivery_id(delivery_id), payload)
    if payload.lease_seconds is not None:
        raise ApiError(
            400, "invalid_request", "lease_seconds: only a finish with next claims", "lease_seconds"
        )
    if payload.error is not None or payload.turn is not None:
        return in_one_transaction(_settle_in_transaction)(request, delivery_id, payload)
    result = services.finish_admitted(
        request_event(_signed(request)),
        _delivery_id(delivery_id),
        payload.generation,
        Outcome(payload.outcome),
    )
    if isinstance(result, LeaseLost):
        return _lease_lost(request)
    return _answer(request, _finish_document(result))


def _settle_in_transaction(
    request: HttpRequest, delivery_id: str, payload: schema.FinishIn
) -> HttpResponse:
    """Admitted, then settled (failed with the reason kept, with ``error``), and the
    agent's turn stored with the settle (with ``turn``), in the request's
    transaction."""
    lease = _lease(_caller(request), delivery_id, payload.generation)
    outcome = Outcome(payload.outcome)
    turn = _checked_turn(payload.turn)
    result = services.finish_delivery(lease, outcome, error=payload.error)
    if isinstance(result, LeaseLost):
        return _lease_lost(request)
    if turn is not None and isinstance(result, Settled):
        record = services.get_delivery(lease.community_id, lease.delivery_id)
        _keep_turn(lease, record.attempts, outcome.value, turn)
    return _answer(request, _finish_document(result))


def _checked_turn(turn: schema.TurnIn | None) -> schema.TurnIn | None:
    """The turn a settle carries, its text within the stored bound."""
    if turn is None:
        return None
    size = len(turn.text.encode())
    limit = min(app_settings.ACP_TRANSCRIPT_BYTES, AGENT_TURN_TEXT_MAX_BYTES)
    if size > limit:
        raise ApiError(
            400, "invalid_request", f"turn.text: {size} bytes; at most {limit}", "turn.text"
        )
    if turn.said_bytes < size:
        raise ApiError(
            400, "invalid_request", "turn.said_bytes: less than the text holds", "turn.said_bytes"
        )
    return turn


def _keep_turn(lease: Lease, attempts: int, outcome: str, turn: schema.TurnIn) -> None:
    services.keep_agent_turn(
        lease,
        attempts=attempts,
        outcome=outcome,
        text=turn.text,
        said_bytes=turn.said_bytes,
        stop_reason=turn.stop_reason,
        tool_calls=[call.model_dump() for call in turn.tool_calls],
        permissions=[asked.model_dump() for asked in turn.permissions],
    )


@api.post(
    "v1/deliveries/{delivery_id}/retry",
    response={200: schema.RetryOut, **ERRORS},
    summary="Give a live lease back after a failed attempt, its error kept, to be retried",
)
@decorate_view(in_one_transaction)
def retry(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.RetryIn):
    lease = _lease(_caller(request), delivery_id, payload.generation)
    turn = _checked_turn(payload.turn)
    result = services.retry_delivery(
        lease, error=payload.error, delay_seconds=payload.delay_seconds
    )
    if isinstance(result, LeaseLost):
        return _lease_lost(request)
    if turn is not None:
        outcome = "failed" if isinstance(result, Exhausted) else "retried"
        _keep_turn(lease, result.attempts, outcome, turn)
    if isinstance(result, Exhausted):
        return _answer(request, {"result": "exhausted", "attempts": result.attempts})
    document = {
        "result": "retried",
        "attempts": result.attempts,
        "available_at": wire.instant(result.available_at),
    }
    return _answer(request, document)


@api.post(
    "v1/deliveries/{delivery_id}/release",
    response={200: schema.ReleaseOut, **ERRORS},
    summary="Give a live lease back unattempted: pending again at once",
)
@decorate_view(in_one_transaction)
def release(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.ReleaseIn):
    lease = _lease(_caller(request), delivery_id, payload.generation)
    if not services.release_lease(lease):
        return _lease_lost(request)
    return _answer(request, {"result": "released"})


@api.post(
    "v1/deliveries/{delivery_id}/reply",
    response={200: schema.ReplyOut, **ERRORS},
    summary="Reply to a held delivery: a message of its run, sent to enrolled agents",
)
@decorate_view(in_one_transaction)
def reply(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.ReplyIn):
    lease = _lease(_caller(request), delivery_id, payload.generation)
    sent = services.reply_to_delivery(
        lease, content=payload.content, to=payload.to, idempotency_key=payload.idempotency_key
    )
    document = {
        "message_id": sent.message.id.hex(),
        "run_id": str(sent.run_id),
        "step_id": sent.step_id,
        "created": sent.created,
        "deliveries": [str(record.id) for record in sent.deliveries],
    }
    return _answer(request, document)


@api.get(
    "v1/deliveries/{delivery_id}/replies",
    response={200: schema.RepliesOut, **ERRORS},
    summary="The replies stored so far in the run of one of the caller's deliveries",
)
@decorate_view(in_one_transaction)
def replies(request: HttpRequest, delivery_id: schema.Uuid):
    caller = _caller(request)
    record = services.get_delivery(caller.community_id, _delivery_id(delivery_id))
    if record is None or record.binding.target_pubkey != caller.pubkey:
        raise Http404
    run_id = record.binding.run_id
    document = {
        "run_id": str(run_id),
        "replies": services.run_replies(caller.community_id, run_id),
    }
    return _answer(request, document)


def _finish_and_claim_next(
    request: HttpRequest, delivery_id: UUID, payload: schema.FinishIn
) -> HttpResponse:
    """Admitted, settled and the next delivery claimed with its message, in one
    statement (``services.finish_and_claim_next_admitted``)."""
    answer = services.finish_and_claim_next_admitted(
        request_event(_signed(request)),
        delivery_id,
        payload.generation,
        payload.outcome,
        lease_seconds=payload.lease_seconds,
    )
    if isinstance(answer.result, LeaseLost):
        return _lease_lost(request)
    document: dict[str, object] = _finish_document(answer.result)
    claimed = answer.next
    document["next"] = None if claimed is None else _claimed(*claimed, claimed.message)
    return _answer(request, document)


@api.post(
    "v1/finish/batch",
    response={200: schema.FinishBatchOut, **ERRORS},
    summary="Settle many claimed deliveries; one result per settlement, in order",
)
@decorate_view(in_one_transaction)
def finish_batch(request: HttpRequest, payload: schema.FinishBatchIn):
    caller = _caller(request)
    pairs = [
        (_lease(caller, item.delivery_id, item.generation), item.outcome)
        for item in payload.settlements
    ]
    results = []
    for (lease, _), result in zip(pairs, services.finish_deliveries(pairs), strict=True):
        document: dict[str, str] = {"delivery_id": str(lease.delivery_id)}
        if isinstance(result, LeaseLost):
            document["result"] = "lease_lost"
        else:
            document |= _finish_document(result)
        results.append(document)
    return Status(200, {"results": results})


@api.get(
    "v1/deliveries/{delivery_id}",
    response={200: schema.DeliveryOut, **ERRORS},
    summary="Read one of the caller's deliveries, with its message",
)
@decorate_view(in_one_transaction)
def get(request: HttpRequest, delivery_id: schema.Uuid):
    caller = _caller(request)
    record = services.get_delivery(caller.community_id, _delivery_id(delivery_id))
    if record is None or record.binding.target_pubkey != caller.pubkey:
        # Another agent's delivery answers exactly as a missing one.
        raise Http404
    message = services.message_events(caller.community_id, [record]).get(record.id)
    return Status(200, wire.delivery_document(record, message=message))


def _prepare_wait(request: HttpRequest, caller: Caller) -> UUID | None:
    """After the waiter is registered and, with wake-ups on, the listener LISTENs: the
    oldest pending delivery already there (committed before we listened), or None.
    Finding none while listening, the caller's target is registered as idle
    (``services.register_idle``) and looked at once more, so a commit lands either
    before that look or after the registration, which makes its producer notify.
    With wake-ups off nothing is sent to listen for; the process's poll of every
    waiter at once (``WakeHub.ensure_sweeping``) looks instead."""
    listening = app_settings.NOTIFY is True and hub.ensure_listening()
    if not listening:
        hub.ensure_sweeping()
    pending = _pending_delivery(request, caller)
    if pending is None and listening:
        pending = _pending_delivery(request, caller, register_idle=True)
    return pending


def _pending_delivery(
    request: HttpRequest, caller: Caller, *, register_idle: bool = False
) -> UUID | None:
    """The caller's oldest claimable delivery (pending and not backing off after a
    retry), or None; with ``register_idle``, asked once the caller's target is
    registered as idle. Waiting work (``connection.waiting_work``): the wait itself
    holds no connection of its own."""
    with waiting_work(request):
        session = hub.session
        if register_idle and session is not None:
            # The hub's session, not this request's (its own may be released meanwhile).
            services.register_idle(caller.community_id, [caller.pubkey], session=session)
        return (
            WorkflowAgentDelivery.objects.claimable()
            .for_target(caller.community_id, caller.pubkey)
            .order_by("created_at", "id")
            .values_list("id", flat=True)
            .first()
        )


def _admit_waiting(request: HttpRequest) -> Caller:
    """A waiting request's admission in autocommit (the wait holds no transaction
    while it waits), as waiting work (``connection.waiting_work``)."""
    with waiting_work(request):
        caller = _caller(request)
        services.prune_replay_guard_now_and_then()
        return caller


def _wake(caller: Caller, delivery_id: UUID) -> Status:
    return Status(200, {"delivery_id": str(delivery_id), "target": caller.pubkey.hex()})


@api.get(
    "v1/wait",
    response={200: schema.WakeOut, 204: None, **ERRORS, 503: schema.ErrorOut},
    summary="Wait until one of the caller's deliveries is committed",
)
async def wait(
    request: HttpRequest,
    timeout: int = Query(30, ge=0, le=60, description="seconds to wait at most (0-60)"),
):
    caller = await sync_to_async(_admit_waiting)(request)
    timeout = min(timeout, app_settings.API_MAX_WAIT_SECONDS)
    if hub.waiting >= app_settings.API_MAX_WAITERS:
        return error(request, 503, "too_many_waiters", "this server has enough waiters; poll")
    waiter = hub.register(caller.community_id, caller.pubkey)
    try:
        pending = await sync_to_async(_prepare_wait)(request, caller)
        if pending is not None:
            return _wake(caller, pending)
        delivery_id = await _until_woken(waiter.future, timeout)
        if delivery_id is None:
            return Status(204, None)
        return _wake(caller, delivery_id)
    finally:
        hub.unregister(caller.community_id, caller.pubkey, waiter)


async def _until_woken(woken: asyncio.Future[UUID | None], timeout: float) -> UUID | None:
    """The delivery a wake-up names (a notification's, or the one the process's poll
    found: the safety poll, or with ``WORKFLOW_DELIVERY_NOTIFY`` off the poll every
    ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``), or None at the timeout (or after the
    listener lost its session)."""
    # asyncio.wait, not wait_for: the timeout must not cancel the future.
    done, _ = await asyncio.wait({woken}, timeout=timeout)
    if done:
        return woken.result()
    return None
