"""Who signed the request: the checks of a NIP-98 ``Authorization`` that need no
database (the body's size, the event's binding to this request and host, its id and
signature). Every refusal is an ``ApiError`` or ``AgentAuthRefused`` with a stable
code; the views never see a request whose signature does not hold. Whether the key
may act in the Host's community, and whether the event is fresh and new, the
services decide in the statement that serves the request (``services.replay``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.http import HttpRequest
from django.http.request import split_domain_port
from ninja.security import APIKeyHeader

from ..conf import app_settings
from ..protocol import RequestEvent
from . import nip98


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


def request_event(signed: Signed) -> RequestEvent:
    """The signed request as the services admit it."""
    return RequestEvent(
        host=signed.host,
        event_id=signed.event.id,
        created_at=signed.event.created_at,
        pubkey=signed.pubkey,
    )


class NostrAuth(APIKeyHeader):
    """django-ninja's hook (and the OpenAPI security scheme) for NIP-98:
    ``request.auth`` is the ``Signed`` request, not yet admitted."""

    param_name = "Authorization"

    def authenticate(self, request: HttpRequest, key: str | None) -> Signed:
        return verify(request)
