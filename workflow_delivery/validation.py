"""Checks and parsers for the values settings, options and service arguments take: whole
numbers, finite numbers, delays, yield ratios and retention durations; and the checks of
arguments the services, the consumer, the admin and the commands share (text, an
operator's name, a list of public keys, a batch size, a yield ratio, a community's
host), each a ``ProtocolError`` naming the argument."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import timedelta

from .exceptions import ProtocolError
from .protocol import as_bytes32

# The longest lease the app hands out whatever the setting says: 10 years (3,650
# days). statement_timestamp() + interval must stay inside PostgreSQL's timestamp
# range (to 294276 AD); a bound far below it also keeps a mistyped setting from
# handing out leases that never end in practice.
LEASE_SECONDS_BOUND = 3650 * 86400


def is_whole_number(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


# The most of an agent turn's streamed text a stored turn holds (UTF-8 bytes), so the
# most WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES may keep (wd_agent_turn_text_bytes).
AGENT_TURN_TEXT_MAX_BYTES = 1048576


def is_transcript_bytes(value: object) -> bool:
    """A bound on a turn's kept text: a whole number from 0 to the stored ceiling."""
    return is_whole_number(value) and 0 <= value <= AGENT_TURN_TEXT_MAX_BYTES


_KEY_HEX = re.compile(r"[0-9a-f]{64}")


def is_key_hex(value: object) -> bool:
    """A 32-byte public key as text: 64 lowercase hex characters."""
    return isinstance(value, str) and _KEY_HEX.fullmatch(value) is not None


def is_number(value: object) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool`` (no inf, no nan)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_delay_seconds(value: object) -> bool:
    """A wait in seconds: a finite number from 0 to ``LEASE_SECONDS_BOUND``."""
    return is_number(value) and 0 <= value <= LEASE_SECONDS_BOUND


def is_yield_ratio(value: object) -> bool:
    """How long the reaper rests after a full batch, in multiples of that batch."""
    return is_number(value) and 0 <= value <= 100


_DURATION = re.compile(r"(\d+)([dhms])")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: object) -> timedelta:
    """``30d``, ``12h``, ``15m`` or ``90s`` (a ``timedelta`` passes as it is, if not
    negative); anything else is a ValueError naming the accepted forms."""
    if isinstance(value, timedelta):
        if value < timedelta(0):
            raise ValueError(f"a duration cannot be negative, not {value}")
        return value
    match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"a duration is a whole number followed by d, h, m or s (30d, 12h, 15m, 90s), "
            f"not {value!r}"
        )
    return timedelta(seconds=int(match[1]) * _UNIT_SECONDS[match[2]])


def checked_text(field: str, value: object) -> str:
    """A string PostgreSQL can store as text: no NUL, valid Unicode."""
    if not isinstance(value, str):
        raise ProtocolError(field, f"must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise ProtocolError(field, "must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(field, "must be valid Unicode (no lone surrogates)") from None
    return value


def checked_operator(value: object) -> str:
    """The name an operator action is recorded under: a non-blank string."""
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError("operator", f"must be a non-blank name, not {value!r}")
    return value


def checked_public_keys(field: str, value: Iterable[bytes]) -> list[bytes]:
    """A list of 32-byte public keys (not a single key's bytes or text), each checked,
    in the order given."""
    if isinstance(value, bytes | bytearray | str):
        raise ProtocolError(field, "must be a list of 32-byte public keys")
    return [as_bytes32(field, key) for key in value]


def checked_batch_size(value: object, default: object = None) -> int:
    """How many rows one batch takes: a positive whole number (``default`` for None)."""
    size = default if value is None else value
    if not (is_whole_number(size) and size >= 1):
        raise ProtocolError("batch_size", f"must be a positive whole number, not {size!r}")
    return size


def checked_batch_seconds(value: object, default: object = None) -> float:
    """How long one batch aims to take: a number of seconds, 0 or more (``default``
    for None)."""
    seconds = default if value is None else value
    if not is_delay_seconds(seconds):
        raise ProtocolError(
            "batch_seconds", f"must be a number of seconds, 0 or more, not {seconds!r}"
        )
    return seconds


def checked_yield_ratio(value: object, default: float) -> float:
    """A sweep's rest after a full batch, in multiples of that batch (``default`` for
    None): a number from 0 to 100."""
    ratio = default if value is None else value
    if not is_yield_ratio(ratio):
        raise ProtocolError("yield_ratio", f"must be a number from 0 to 100, not {ratio!r}")
    return ratio


# A host as a Host header names it, without its port: DNS labels of letters, digits
# and inner hyphens, joined by dots.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
MAX_HOST_LENGTH = 253


def as_host(value: object) -> str:
    """A community host, lower-cased (the API matches hosts in any case)."""
    if not isinstance(value, str):
        raise ProtocolError("host", f"must be a string, not {type(value).__name__}")
    host = value.lower()
    if not (0 < len(host) <= MAX_HOST_LENGTH and _HOST.fullmatch(host)):
        raise ProtocolError(
            "host",
            f"{value[:80]!r} is not a host name (dot-separated labels of letters, digits "
            f"and inner hyphens, at most {MAX_HOST_LENGTH} characters, no port)",
        )
    return host
