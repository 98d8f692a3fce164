"""NIP-98 HTTP Auth: the signed event an agent puts in ``Authorization: Nostr <base64>``.

Pure functions, no Django and no I/O: parsing the header, the NIP-01 event id, the
BIP-340 signature (behind ``verify_signature``, the one call into coincurve), the
request checks (kind, URL, method, payload hash), and the signing side for clients.
Every refusal raises ``AgentAuthRefused`` with a stable code.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass

import coincurve

from ..exceptions import AgentAuthRefused

__all__ = [
    "HTTP_AUTH_KIND",
    "SCHEME",
    "SignedEvent",
    "check_host",
    "check_request",
    "event_id",
    "parse_authorization",
    "public_key",
    "sign_request",
    "verify_event",
    "verify_signature",
]

HTTP_AUTH_KIND = 27235
SCHEME = "Nostr"
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


def event_id(
    pubkey: bytes, created_at: int, kind: int, tags: list[list[str]], content: str
) -> bytes:
    """The NIP-01 id: sha256 of the compact UTF-8 JSON ``[0, pubkey, created_at, kind,
    tags, content]`` (Python's JSON escaping without ensure_ascii is NIP-01's)."""
    serialised = json.dumps(
        [0, pubkey.hex(), created_at, kind, tags, content],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(serialised.encode("utf-8", "surrogatepass")).digest()


def verify_signature(pubkey: bytes, message: bytes, signature: bytes) -> bool:
    """BIP-340: is ``signature`` the x-only key ``pubkey``'s Schnorr signature of the
    32-byte ``message``? False for a key that is not a curve point; never raises."""
    try:
        return coincurve.PublicKeyXOnly(pubkey).verify(signature, message)
    except (ValueError, TypeError):
        return False


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


def public_key(secret_key: bytes) -> bytes:
    """The 32-byte x-only public key of a secret key."""
    return coincurve.PublicKeyXOnly.from_secret(secret_key).format()


def sign_request(
    secret_key: bytes,
    *,
    url: str,
    method: str,
    body: bytes = b"",
    created_at: int | None = None,
    kind: int = HTTP_AUTH_KIND,
    tags: list[list[str]] | None = None,
    host: str | None = None,
) -> str:
    """The ``Authorization`` value for one request: a fresh NIP-98 event signed by
    ``secret_key``, naming the community's ``host`` in a ``host`` tag when given
    (``tags`` replaces the derived ones, for tests of refusals)."""
    pubkey = public_key(secret_key)
    stamp = int(time.time()) if created_at is None else created_at
    if tags is None:
        tags = [["u", url], ["method", method]]
        if body:
            tags.append(["payload", hashlib.sha256(body).hexdigest()])
        if host is not None:
            tags.append(["host", host])
    # A random nonce tag keeps two requests signed in the same second distinct events.
    tags = [*tags, ["nonce", os.urandom(8).hex()]]
    digest = event_id(pubkey, stamp, kind, tags, "")
    signature = coincurve.PrivateKey(secret_key).sign_schnorr(digest, os.urandom(32))
    document = {
        "id": digest.hex(),
        "pubkey": pubkey.hex(),
        "created_at": stamp,
        "kind": kind,
        "tags": tags,
        "content": "",
        "sig": signature.hex(),
    }
    encoded = base64.b64encode(json.dumps(document, separators=(",", ":")).encode()).decode()
    return f"{SCHEME} {encoded}"
