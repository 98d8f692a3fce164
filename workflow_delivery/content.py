"""A message's content, text or a JSON value: checked, and encoded as the text that is
stored and hashed into the message's id.

Text is stored as given. A JSON value is stored twice over in one row: as its compact
encoding (keys sorted, no spaces, non-ASCII kept) in ``content``, the string the
message's NIP-01 id covers, and as ``jsonb`` beside it; a CHECK keeps the two equal.
``content_size`` is the size either kind takes in ``content``: the one figure a bound
on content needs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .exceptions import ProtocolError
from .protocol import ContentKind

__all__ = ["MAX_JSON_DEPTH", "content_size", "encode_content"]

# The deepest nesting of arrays and objects a JSON content may have.
MAX_JSON_DEPTH = 64


def _text(where: str, value: str) -> None:
    if "\x00" in value:
        raise ProtocolError("content", f"{where} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(
            "content", f"{where} must be valid Unicode (no lone surrogates)"
        ) from None


def _check_json(value: object, where: str, depth: int) -> None:
    """Raise ``ProtocolError`` naming the first part of ``value`` that JSON (as
    PostgreSQL's ``jsonb`` stores it) cannot hold."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        _text(where, value)
    elif isinstance(value, int):
        return
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError("content", f"{where} is {value!r}: JSON has no NaN or infinity")
    elif isinstance(value, list | tuple | dict):
        if depth >= MAX_JSON_DEPTH:
            raise ProtocolError(
                "content",
                f"{where} is nested deeper than {MAX_JSON_DEPTH} levels (or contains itself)",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ProtocolError(
                        "content",
                        f"{where} has the key {key!r}: a JSON object's keys are strings",
                    )
                _text(f"{where}'s key {key[:40]!r}", key)
                _check_json(item, f"{where}[{key[:40]!r}]", depth + 1)
        else:
            for index, item in enumerate(value):
                _check_json(item, f"{where}[{index}]", depth + 1)
    else:
        raise ProtocolError(
            "content", f"{where} is a {type(value).__name__}, which is not a JSON value"
        )


def encode_content(
    content: Any, content_kind: ContentKind | str | None = None
) -> tuple[ContentKind, str]:
    """Check ``content`` as ``content_kind`` and return ``(kind, text)``: the kind, and
    the text stored in ``content`` (and hashed into the message's id).

    With no kind, a ``str`` is text and anything else but ``None`` a JSON value; a
    JSON string, or null, needs ``content_kind="json"``. Anything the kind cannot hold is
    ``ProtocolError`` naming ``content`` and the part that is wrong (a NUL or a lone
    surrogate, NaN or infinity, a key that is not a string, a value of another type,
    nesting deeper than ``MAX_JSON_DEPTH``)."""
    if content_kind is None:
        if content is None:
            raise ProtocolError(
                "content", "must be given: text, or a JSON value (null needs content_kind='json')"
            )
        kind = ContentKind.TEXT if isinstance(content, str) else ContentKind.JSON
    else:
        try:
            kind = ContentKind(content_kind)
        except ValueError:
            raise ProtocolError(
                "content_kind", f"must be 'text' or 'json', not {content_kind!r}"
            ) from None
    if kind is ContentKind.TEXT:
        if not isinstance(content, str):
            raise ProtocolError("content", f"must be a string, not {type(content).__name__}")
        _text("content", content)
        return kind, content
    _check_json(content, "content", 0)
    try:
        text = json.dumps(
            content, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # an integer longer than Python converts to text
        raise ProtocolError("content", f"is not JSON-serialisable: {exc}") from None
    return kind, text


def content_size(content: Any, content_kind: ContentKind | str | None = None) -> int:
    """The bytes ``content`` takes when stored (the UTF-8 length of its stored text);
    ``ProtocolError`` as ``encode_content`` for content it refuses."""
    return len(encode_content(content, content_kind)[1].encode("utf-8"))
