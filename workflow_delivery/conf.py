"""The app's settings, prefixed ``WORKFLOW_DELIVERY_`` and read on every access."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    "DEFAULT_LEASE_SECONDS": 60,
    "MAX_LEASE_SECONDS": 605200,
    "REAP_BATCH_SIZE": 500,
    "REAP_INTERVAL_SECONDS": 5.0,
    "REAP_YIELD_RATIO": 1.0,
    "PREPARED_STATEMENTS": True,
    # The agent HTTP API (workflow_delivery.api).
    "API_ORIGIN": None,
    "API_MAX_CLOCK_SKEW_SECONDS": 60,
    "API_MAX_BODY_BYTES": 65536,
    "API_MAX_WAIT_SECONDS": 60,
    "API_MAX_WAITERS": 1000,
    "API_REPLAY_PRUNE_INTERVAL_SECONDS": 60.0,
    # Producer commits send a wake-up per created delivery (see wakeups.py).
    "NOTIFY": True,
}


class AppSettings:
    prefix = "WORKFLOW_DELIVERY_"

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        return getattr(settings, self.prefix + name, DEFAULTS[name])


app_settings = AppSettings()


def is_whole_number(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_yield_ratio(value: object) -> bool:
    """How long the reaper rests after a full batch, in multiples of that batch."""
    return is_number(value) and 0 <= value <= 100
