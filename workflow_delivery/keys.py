"""An agent's keys and what they sign: secp256k1 key pairs with x-only public keys
(BIP-340), the NIP-01 event id, Schnorr signatures, and the NIP-98 ``Authorization``
value of one HTTP request.

Standard library only at import; the curve arithmetic is coincurve's, imported on
first use, so this module (and the agent's client built on it) imports without
coincurve and says which extra to install when a key is first needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from types import ModuleType

from .exceptions import ProtocolError

__all__ = [
    "HTTP_AUTH_KIND",
    "SCHEME",
    "KeysUnavailable",
    "SigningKey",
    "event_id",
    "new_key_pair",
    "public_key",
    "public_key_bytes",
    "secret_key_bytes",
    "sign",
    "sign_request",
    "verify_signature",
]

HTTP_AUTH_KIND = 27235
SCHEME = "Nostr"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_INSTALL = "pip install 'buzz-workflow-delivery[client]'"


class KeysUnavailable(ImportError):
    """coincurve, which the key functions need, is not installed."""


def _coincurve() -> ModuleType:
    try:
        import coincurve
    except ImportError as exc:
        raise KeysUnavailable(
            f"workflow_delivery.keys needs coincurve, which the [client] and [api] extras "
            f"install: {_INSTALL}"
        ) from exc
    return coincurve


def secret_key_bytes(secret: bytes | str, *, field: str = "secret_key") -> bytes:
    """A secret key as its 32 bytes, from 32 bytes or 64 hex characters (either case).
    A ``ProtocolError`` naming ``field`` otherwise; the value itself is never quoted."""
    if isinstance(secret, str):
        text = secret.strip().lower()
        if not _HEX64.fullmatch(text):
            raise ProtocolError(field, "must be 32 bytes or 64 hex characters")
        return bytes.fromhex(text)
    if not isinstance(secret, bytes) or len(secret) != 32:
        raise ProtocolError(field, "must be 32 bytes or 64 hex characters")
    return secret


def public_key_bytes(secret: bytes | str) -> bytes:
    """The 32-byte x-only public key of a secret key (32 bytes or 64 hex)."""
    key = secret_key_bytes(secret)
    try:
        return _coincurve().PublicKeyXOnly.from_secret(key).format()
    except ValueError as exc:
        # Zero, or not below the curve order: no key pair has it as its secret.
        raise ProtocolError("secret_key", "is not a valid secp256k1 secret key") from exc


def public_key(secret: bytes | str) -> str:
    """The x-only public key of a secret key, as 64 lowercase hex characters: the key
    an agent is addressed by (a delivery's ``target_pubkey``)."""
    return public_key_bytes(secret).hex()


def new_key_pair() -> tuple[str, str]:
    """A fresh random key pair, ``(secret_hex, public_hex)``."""
    secret = _coincurve().PrivateKey().secret
    return secret.hex(), public_key(secret)


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


def sign(secret: bytes | str, message: bytes) -> bytes:
    """The BIP-340 Schnorr signature (64 bytes) of a 32-byte ``message`` (an event id)."""
    key = secret_key_bytes(secret)
    return _coincurve().PrivateKey(key).sign_schnorr(message, os.urandom(32))


def verify_signature(pubkey: bytes, message: bytes, signature: bytes) -> bool:
    """BIP-340: is ``signature`` the x-only key ``pubkey``'s Schnorr signature of the
    32-byte ``message``? False for a key that is not a curve point; never raises for
    bad input."""
    coincurve = _coincurve()
    try:
        return coincurve.PublicKeyXOnly(pubkey).verify(signature, message)
    except (ValueError, TypeError):
        return False


class SigningKey:
    """One secret key ready to sign: the curve's key object and the x-only public key
    derived once, where the functions above derive them on every call. An agent that
    signs every request keeps one (``AgentClient`` does)."""

    __slots__ = ("_key", "pubkey")

    def __init__(self, secret: bytes | str) -> None:
        key = secret_key_bytes(secret)
        try:
            self._key = _coincurve().PrivateKey(key)
        except ValueError as exc:
            raise ProtocolError("secret_key", "is not a valid secp256k1 secret key") from exc
        # The x-only key: the compressed point without its parity byte.
        self.pubkey: bytes = self._key.public_key.format(compressed=True)[1:]

    def __repr__(self) -> str:
        # Never the secret.
        return f"SigningKey(pubkey={self.pubkey.hex()})"

    def sign(self, message: bytes) -> bytes:
        """The BIP-340 Schnorr signature (64 bytes) of a 32-byte ``message``."""
        return self._key.sign_schnorr(message, os.urandom(32))

    def sign_request(
        self,
        *,
        url: str,
        method: str,
        body: bytes = b"",
        created_at: int | None = None,
        kind: int = HTTP_AUTH_KIND,
        tags: list[list[str]] | None = None,
        host: str | None = None,
    ) -> str:
        """The ``Authorization`` value for one request, as ``sign_request`` makes it."""
        stamp = int(time.time()) if created_at is None else created_at
        if tags is None:
            tags = [["u", url], ["method", method]]
            if body:
                tags.append(["payload", hashlib.sha256(body).hexdigest()])
            if host is not None:
                tags.append(["host", host])
        # A random nonce tag keeps two requests signed in the same second distinct events.
        tags = [*tags, ["nonce", os.urandom(8).hex()]]
        digest = event_id(self.pubkey, stamp, kind, tags, "")
        document = {
            "id": digest.hex(),
            "pubkey": self.pubkey.hex(),
            "created_at": stamp,
            "kind": kind,
            "tags": tags,
            "content": "",
            "sig": self.sign(digest).hex(),
        }
        encoded = base64.b64encode(json.dumps(document, separators=(",", ":")).encode()).decode()
        return f"{SCHEME} {encoded}"


def sign_request(
    secret_key: bytes | str,
    *,
    url: str,
    method: str,
    body: bytes = b"",
    created_at: int | None = None,
    kind: int = HTTP_AUTH_KIND,
    tags: list[list[str]] | None = None,
    host: str | None = None,
) -> str:
    """The ``Authorization`` value for one request (NIP-98): a fresh event signed by
    ``secret_key`` naming the exact URL, the method, the body's sha256 when there is a
    body, and the community's ``host`` in a ``host`` tag when given (``tags``
    replaces the derived ones, for tests of refusals)."""
    return SigningKey(secret_key).sign_request(
        url=url, method=method, body=body, created_at=created_at, kind=kind, tags=tags, host=host
    )
