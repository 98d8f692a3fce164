"""Checks and parsers for the values settings, options and service arguments take: whole
numbers, finite numbers, delays, yield ratios and retention durations."""

from __future__ import annotations

import math
import re
from datetime import timedelta

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
