"""The agent HTTP API's endpoints: claim, renew, finish (or fail with a reason, retry,
release), reply, read and wait, each scoped to the key that signed the request, in
the community named by the Host header. Results map to answers; everything else is
an error answer with a stable code (``api.answers``).
"""

from __future__ import annotations

from uuid import UUID

from asgiref.sync import sync_to_async
from django.http import Http404, HttpRequest, HttpResponse
from ninja import Query, Status
from ninja.decorators import decorate_view

from .. import services, wire
from ..conf import app_settings
from ..protocol import (
    AlreadyTerminal,
    Exhausted,
    Lease,
    LeaseLost,
    Outcome,
    Renewed,
    Settled,
)
from ..validation import AGENT_TURN_TEXT_MAX_BYTES
from . import schema
from .answers import (
    ERRORS,
    Caller,
    answered,
    api,
    caller_lease,
    checked_delivery_id,
    claimed_document,
    error,
    in_one_transaction,
    lease_lost,
    request_caller,
    served_alone,
    signed_request,
)
from .auth import ApiError, Signed, request_event
from .connection import check_connection
from .waiting import admit_waiting, claim_waiting, prepare_wait, until_woken
from .wake import hub

__all__ = ["api"]


@api.post(
    "v1/claim",
    response={200: schema.ClaimOut, 204: None, **ERRORS, 503: schema.ErrorOut},
    summary="Claim the caller's oldest pending delivery (or the one named), waiting if asked",
)
def claim(request: HttpRequest, payload: schema.ClaimIn | None = None):
    signed = signed_request(request)
    payload = payload or schema.ClaimIn()
    if payload.wait and (payload.delivery_id is not None or payload.expected is not None):
        raise ApiError(
            400, "invalid_request", "wait: only a claim of any delivery may wait", "wait"
        )
    if payload.wait:
        return claim_waiting(request, signed, payload)
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
        return answered(request, claimed_document(*claimed, claimed.message))
    finally:
        services.prune_replay_guard_now_and_then()


@api.post(
    "v1/claim/batch",
    response={200: schema.ClaimBatchOut, **ERRORS},
    summary="Claim up to `limit` of the caller's oldest pending deliveries",
)
@decorate_view(served_alone)
def claim_batch(request: HttpRequest, payload: schema.ClaimBatchIn):
    _, claimed = services.claim_batch_admitted(
        request_event(signed_request(request)),
        limit=payload.limit,
        lease_seconds=payload.lease_seconds,
    )
    return answered(
        request, {"claimed": [claimed_document(*item, item.message) for item in claimed]}
    )


@api.post(
    "v1/deliveries/{delivery_id}/renew",
    response={200: schema.RenewOut, **ERRORS},
    summary="Extend a live lease",
)
@decorate_view(served_alone)
def renew(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.RenewIn):
    result = services.renew_admitted(
        request_event(signed_request(request)),
        checked_delivery_id(delivery_id),
        payload.generation,
        lease_seconds=payload.lease_seconds,
    )
    if isinstance(result, Renewed):
        return answered(request, {"lease_until": wire.instant(result.lease_until)})
    return lease_lost(request)


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
        return _finish_and_claim_next(request, checked_delivery_id(delivery_id), payload)
    if payload.lease_seconds is not None:
        raise ApiError(
            400, "invalid_request", "lease_seconds: only a finish with next claims", "lease_seconds"
        )
    if payload.error is not None or payload.turn is not None:
        return in_one_transaction(_settle_in_transaction)(request, delivery_id, payload)
    result = services.finish_admitted(
        request_event(signed_request(request)),
        checked_delivery_id(delivery_id),
        payload.generation,
        Outcome(payload.outcome),
    )
    if isinstance(result, LeaseLost):
        return lease_lost(request)
    return answered(request, _finish_document(result))


def _settle_in_transaction(
    request: HttpRequest, delivery_id: str, payload: schema.FinishIn
) -> HttpResponse:
    """Admitted, then settled (failed with the reason kept, with ``error``), and the
    agent's turn stored with the settle (with ``turn``), in the request's
    transaction."""
    lease = caller_lease(request_caller(request), delivery_id, payload.generation)
    outcome = Outcome(payload.outcome)
    turn = _checked_turn(payload.turn)
    result = services.finish_delivery(lease, outcome, error=payload.error)
    if isinstance(result, LeaseLost):
        return lease_lost(request)
    if turn is not None and isinstance(result, Settled):
        record = services.get_delivery(lease.community_id, lease.delivery_id)
        _keep_turn(lease, record.attempts, outcome.value, turn)
    return answered(request, _finish_document(result))


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
    lease = caller_lease(request_caller(request), delivery_id, payload.generation)
    turn = _checked_turn(payload.turn)
    result = services.retry_delivery(
        lease, error=payload.error, delay_seconds=payload.delay_seconds
    )
    if isinstance(result, LeaseLost):
        return lease_lost(request)
    if turn is not None:
        outcome = "failed" if isinstance(result, Exhausted) else "retried"
        _keep_turn(lease, result.attempts, outcome, turn)
    if isinstance(result, Exhausted):
        return answered(request, {"result": "exhausted", "attempts": result.attempts})
    document = {
        "result": "retried",
        "attempts": result.attempts,
        "available_at": wire.instant(result.available_at),
    }
    return answered(request, document)


@api.post(
    "v1/deliveries/{delivery_id}/release",
    response={200: schema.ReleaseOut, **ERRORS},
    summary="Give a live lease back unattempted: pending again at once",
)
@decorate_view(in_one_transaction)
def release(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.ReleaseIn):
    lease = caller_lease(request_caller(request), delivery_id, payload.generation)
    if not services.release_lease(lease):
        return lease_lost(request)
    return answered(request, {"result": "released"})


@api.post(
    "v1/deliveries/{delivery_id}/reply",
    response={200: schema.ReplyOut, **ERRORS},
    summary="Reply to a held delivery: a message of its run, sent to enrolled agents",
)
@decorate_view(in_one_transaction)
def reply(request: HttpRequest, delivery_id: schema.Uuid, payload: schema.ReplyIn):
    lease = caller_lease(request_caller(request), delivery_id, payload.generation)
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
    return answered(request, document)


@api.get(
    "v1/deliveries/{delivery_id}/replies",
    response={200: schema.RepliesOut, **ERRORS},
    summary="The replies stored so far in the run of one of the caller's deliveries",
)
@decorate_view(in_one_transaction)
def replies(request: HttpRequest, delivery_id: schema.Uuid):
    caller = request_caller(request)
    record = services.get_delivery(caller.community_id, checked_delivery_id(delivery_id))
    if record is None or record.binding.target_pubkey != caller.pubkey:
        raise Http404
    run_id = record.binding.run_id
    document = {
        "run_id": str(run_id),
        "replies": services.run_replies(caller.community_id, run_id),
    }
    return answered(request, document)


def _finish_and_claim_next(
    request: HttpRequest, delivery_id: UUID, payload: schema.FinishIn
) -> HttpResponse:
    """Admitted, settled and the next delivery claimed with its message, in one
    statement (``services.finish_and_claim_next_admitted``)."""
    answer = services.finish_and_claim_next_admitted(
        request_event(signed_request(request)),
        delivery_id,
        payload.generation,
        payload.outcome,
        lease_seconds=payload.lease_seconds,
    )
    if isinstance(answer.result, LeaseLost):
        return lease_lost(request)
    document: dict[str, object] = _finish_document(answer.result)
    claimed = answer.next
    document["next"] = None if claimed is None else claimed_document(*claimed, claimed.message)
    return answered(request, document)


@api.post(
    "v1/finish/batch",
    response={200: schema.FinishBatchOut, **ERRORS},
    summary="Settle many claimed deliveries; one result per settlement, in order",
)
@decorate_view(in_one_transaction)
def finish_batch(request: HttpRequest, payload: schema.FinishBatchIn):
    caller = request_caller(request)
    pairs = [
        (caller_lease(caller, item.delivery_id, item.generation), item.outcome)
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
    caller = request_caller(request)
    record = services.get_delivery(caller.community_id, checked_delivery_id(delivery_id))
    if record is None or record.binding.target_pubkey != caller.pubkey:
        # Another agent's delivery answers exactly as a missing one.
        raise Http404
    message = services.message_events(caller.community_id, [record]).get(record.id)
    return Status(200, wire.delivery_document(record, message=message))


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
    caller = await sync_to_async(admit_waiting)(request)
    timeout = min(timeout, app_settings.API_MAX_WAIT_SECONDS)
    if hub.waiting >= app_settings.API_MAX_WAITERS:
        return error(request, 503, "too_many_waiters", "this server has enough waiters; poll")
    waiter = hub.register(caller.community_id, caller.pubkey)
    try:
        pending = await sync_to_async(prepare_wait)(request, caller)
        if pending is not None:
            return _wake(caller, pending)
        delivery_id = await until_woken(waiter.future, timeout)
        if delivery_id is None:
            return Status(204, None)
        return _wake(caller, delivery_id)
    finally:
        hub.unregister(caller.community_id, caller.pubkey, waiter)
