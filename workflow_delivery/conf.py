"""The app's settings, prefixed ``WORKFLOW_DELIVERY_`` and read on every access."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    "DEFAULT_LEASE_SECONDS": 60,
    "MAX_LEASE_SECONDS": 604800,  # 7 days
    "REAP_BATCH_SIZE": 500,
    "REAP_INTERVAL_SECONDS": 5.0,
    "REAP_YIELD_RATIO": 1.0,
    "PREPARED_STATEMENTS": True,
    # Producer commits send a wake-up per created delivery (see wakeups.py): right
    # after the commit, or (IN_TRANSACTION) from the insert itself, which costs more.
    "NOTIFY": True,
    "NOTIFY_IN_TRANSACTION": False,
}


class AppSettings:
    prefix = "WORKFLOW_DELIVERY_"

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        return getattr(settings, self.prefix + name, DEFAULTS[name])


app_settings = AppSettings()


# The longest lease the app hands out whatever the setting says: 10 years (3,650
# days). statement_timestamp() + interval must stay inside PostgreSQL's timestamp
# range (to 294276 AD); a bound far below it also keeps a mistyped setting from
# handing out leases that never end in practice.
LEASE_SECONDS_BOUND = 3650 * 86400


def is_whole_number(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool`` (no inf, no nan)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_yield_ratio(value: object) -> bool:
    """How long the reaper rests after a full batch, in multiples of that batch."""
    return is_number(value) and 0 <= value <= 100
