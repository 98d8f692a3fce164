"""What every endpoint of the agent HTTP API shares: the API object and its error
answers (``{"error": code, "detail": text}`` with a stable code), the caller's
admission, the caller's lease and the answer documents.

The OpenAPI 3 document is derived from the views by django-ninja.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import wraps
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, transaction
from django.db import Error as DatabaseError
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from .. import services, wire
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
from ..protocol import DeliveryRecord, Lease, MessageEvent, as_uuid
from ..store.run import one_transaction
from . import schema
from .auth import ApiError, NostrAuth, Signed, request_event
from .connection import check_connection


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
def database_unavailable(request: HttpRequest, exc: DatabaseError) -> HttpResponse:
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
    return lease_lost(request)


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


def lease_lost(request: HttpRequest) -> HttpResponse:
    return error(
        request, 409, "lease_lost", "the lease is expired, reaped, superseded or not yours"
    )


@dataclass(frozen=True, slots=True)
class Caller:
    """An admitted request: its community and the agent key that signed it."""

    community_id: UUID
    pubkey: bytes
    event_id: bytes


def request_caller(request: HttpRequest) -> Caller:
    """The signed request admitted by the services (``services.admit``: the Host's
    community, the key's standing, freshness, the replay guard), once per request.
    In the request's transaction (``in_one_transaction``), so the replay row commits
    with the operation or not at all."""
    caller = getattr(request, "_workflow_delivery_caller", None)
    if caller is None:
        signed = signed_request(request)
        community_id = services.admit(request_event(signed))
        caller = Caller(community_id=community_id, pubkey=signed.pubkey, event_id=signed.event.id)
        request._workflow_delivery_caller = caller  # type: ignore[attr-defined]
    return caller


def checked_delivery_id(value: str) -> UUID:
    try:
        return as_uuid("delivery_id", value)
    except ProtocolError as exc:
        raise ApiError(400, "invalid_request", str(exc), "delivery_id") from None


def caller_lease(caller: Caller, delivery_id: str, generation: int) -> Lease:
    # The database judges expiry by its own clock; a lease's lease_until is never read.
    return Lease(
        community_id=caller.community_id,
        delivery_id=checked_delivery_id(delivery_id),
        target_pubkey=caller.pubkey,
        generation=generation,
        lease_until=datetime.min.replace(tzinfo=UTC),
    )


def claimed_document(
    lease: Lease, record: DeliveryRecord, message: MessageEvent | None
) -> dict[str, object]:
    return {
        "lease": wire.lease_document(lease),
        "delivery": wire.delivery_document(record, message=message),
    }


def signed_request(request: HttpRequest) -> Signed:
    return request.auth  # type: ignore[attr-defined,return-value]


def answered(request: HttpRequest, document: dict) -> HttpResponse:
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
