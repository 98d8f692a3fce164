"""NIP-98 HTTP Auth: the signed event an agent puts in ``Authorization: Nostr <base64>``.

The server's side, pure functions with no Django and no I/O: parsing the header, the
event's id and BIP-340 signature, and the request checks (kind, URL, method, payload
hash, host). Every refusal raises ``AgentAuthRefused`` with a stable code. The keys,
the id and the signing side (``sign_request``) are ``workflow_delivery.keys``'s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass

from ..exceptions import AgentAuthRefused
from ..keys import HTTP_AUTH_KIND, SCHEME, event_id, sign_request, verify_signature

__all__ = [
    "HTTP_AUTH_KIND",
    "SCHEME",
    "SignedEvent",
    "check_host",
    "check_request",
    "event_id",
    "parse_authorization",
    "sign_request",
    "verify_event",
    "verify_signature",
]

# A NIP-98 event is a few hundred bytes; anything far larger is not one.
MAX_HEADER_CHARS = 8192
MAX_CREATED_AT = 2**40

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


@dataclass(frozen=True, slots=True)
class SignedEvent:
    id: bytes
    pubkey: bytes
    created_at: int
    kind: int
    tags: list[list[str]]
    content: str
    sig: bytes

    def tag(self, name: str) -> str | None:
        """The value of the event's single ``name`` tag, or None when it has none."""
        values = [tag[1:2] for tag in self.tags if tag and tag[0] == name]
        if [] in values:
            raise AgentAuthRefused("auth_malformed", f"the event's {name!r} tag has no value")
        if len(values) > 1:
            raise AgentAuthRefused("auth_malformed", f"the event repeats its {name!r} tag")
        return values[0][0] if values else None


def _malformed(detail: str) -> AgentAuthRefused:
    return AgentAuthRefused("auth_malformed", detail)


def _hex(document: dict, field: str, pattern: re.Pattern[str]) -> bytes:
    value = document.get(field)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _malformed(f"the event's {field!r} must be lowercase hex of the right length")
    return bytes.fromhex(value)


def _integer(document: dict, field: str) -> int:
    value = document.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_CREATED_AT:
        raise _malformed(f"the event's {field!r} must be a non-negative integer")
    return value


def parse_authorization(header: str | None) -> SignedEvent:
    """The event of an ``Authorization: Nostr <base64 JSON event>`` header."""
    if not header:
        raise AgentAuthRefused("auth_missing", "send Authorization: Nostr <base64 signed event>")
    scheme, _, encoded = header.partition(" ")
    if scheme != SCHEME or not encoded:
        raise AgentAuthRefused("auth_missing", "the Authorization scheme must be 'Nostr'")
    if len(encoded) > MAX_HEADER_CHARS:
        raise _malformed("the Authorization event is too large")
    try:
        document = json.loads(base64.b64decode(encoded.strip(), validate=True))
    except (binascii.Error, ValueError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser's stack, never an event.
        raise _malformed("the Authorization value must be base64 of a JSON event") from exc
    if not isinstance(document, dict):
        raise _malformed("the Authorization event must be a JSON object")
    tags = document.get("tags")
    if not isinstance(tags, list) or not all(
        isinstance(tag, list) and all(isinstance(item, str) for item in tag) for tag in tags
    ):
        raise _malformed("the event's 'tags' must be a list of lists of strings")
    content = document.get("content")
    if not isinstance(content, str):
        raise _malformed("the event's 'content' must be a string")
    return SignedEvent(
        id=_hex(document, "id", _HEX64),
        pubkey=_hex(document, "pubkey", _HEX64),
        created_at=_integer(document, "created_at"),
        kind=_integer(document, "kind"),
        tags=tags,
        content=content,
        sig=_hex(document, "sig", _HEX128),
    )


def verify_event(event: SignedEvent) -> bytes:
    """Check the event's id and signature; returns the signing key (the caller)."""
    if event_id(event.pubkey, event.created_at, event.kind, event.tags, event.content) != event.id:
        raise AgentAuthRefused("auth_bad_id", "the event id is not the hash of the event")
    if not verify_signature(event.pubkey, event.id, event.sig):
        raise AgentAuthRefused("auth_bad_signature", "the signature does not verify for pubkey")
    return event.pubkey


def check_host(event: SignedEvent, host: str, *, required: bool) -> None:
    """The event's binding to one community: its ``host`` tag, when it has one (or
    must have one), names ``host`` (any case, no port)."""
    signed_host = event.tag("host")
    if signed_host is None:
        if required:
            raise AgentAuthRefused(
                "auth_host_missing", "behind a shared origin the event must sign a 'host' tag"
            )
        return
    if signed_host.strip("[]").lower() != host.strip("[]").lower():
        raise AgentAuthRefused("auth_host_mismatch", f"the 'host' tag must be {host}")


def check_request(event: SignedEvent, *, url: str, method: str, body: bytes) -> None:
    """The NIP-98 binding of the event to this request: kind, exact URL, method, and
    the body's sha256 (required whenever there is a body)."""
    if event.kind != HTTP_AUTH_KIND:
        raise AgentAuthRefused("auth_wrong_kind", f"the event kind must be {HTTP_AUTH_KIND}")
    signed_url = event.tag("u")
    if signed_url != url:
        raise AgentAuthRefused("auth_url_mismatch", f"the 'u' tag must be exactly {url}")
    signed_method = event.tag("method")
    if signed_method != method:
        raise AgentAuthRefused("auth_method_mismatch", f"the 'method' tag must be {method}")
    payload = event.tag("payload")
    if payload is None:
        if body:
            raise AgentAuthRefused(
                "auth_payload_missing", "a request with a body must sign its sha256 in 'payload'"
            )
        return
    if payload != hashlib.sha256(body).hexdigest():
        raise AgentAuthRefused("auth_payload_mismatch", "the body is not the one that was signed")
