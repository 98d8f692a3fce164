"""The app's settings, prefixed ``WORKFLOW_DELIVERY_``, read on first access and again
after every ``override_settings`` change of one of them."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed


class WorkflowDeliveryConfigurationError(ImproperlyConfigured):
    """A WORKFLOW_DELIVERY_* setting is unusable."""


DEFAULTS: dict[str, Any] = {
    "DEFAULT_LEASE_SECONDS": 60,
    "MAX_LEASE_SECONDS": 604800,  # 7 days
    "REAP_BATCH_SIZE": 500,
    "REAP_INTERVAL_SECONDS": 5.0,
    # After a full batch the reaper rests this many times the batch's duration, so a
    # large backlog leaves most of the database to live holders (bench/run.py reap).
    "REAP_YIELD_RATIO": 4.0,
    "PREPARED_STATEMENTS": True,
    # The agent HTTP API (workflow_delivery.api).
    "API_ORIGIN": None,
    "API_MAX_CLOCK_SKEW_SECONDS": 60,
    "API_MAX_BODY_BYTES": 65536,
    "API_MAX_WAIT_SECONDS": 60,
    "API_MAX_WAITERS": 1000,
    "API_REPLAY_PRUNE_INTERVAL_SECONDS": 60.0,
    # With NOTIFY off, a ``wait`` looks for the caller's pending deliveries this often.
    "API_WAIT_POLL_SECONDS": 2.0,
    # Wake-ups (wakeups.py): a consumer with nothing to claim registers its targets as
    # idle, and a producer's insert notifies only those, once each, consuming the
    # registration; with busy or absent consumers it sends none. From the insert
    # itself, delivered with the commit, or (IN_TRANSACTION False) in a statement of
    # their own right after it. Must be a real bool (checks: E011, E012).
    "NOTIFY": True,
    "NOTIFY_IN_TRANSACTION": True,
    # Claims a delivery may use; an expired lease past it is settled failed. None: no cap.
    "MAX_ATTEMPTS": 20,
    # A retried delivery waits min(MAX, BASE * 2^(attempts - 1)) seconds, times a random
    # factor from 0.5 to 1, before a claim may take it again (services.retry_delivery).
    "RETRY_BACKOFF_SECONDS": 1.0,
    "RETRY_BACKOFF_MAX_SECONDS": 300.0,
    # How long terminal deliveries are kept (prune_deliveries, reap_deliveries --prune).
    "RETENTION": "30d",
    "PRUNE_BATCH_SIZE": 1000,
    # The same rest for retention, which runs on a schedule rather than after an
    # outage: measured at 1.0 (bench/run.py prune).
    "PRUNE_YIELD_RATIO": 1.0,
    # Record each delivery's transitions (the timeline trigger) for the app's sessions.
    "TIMELINE": True,
    # Community id (text) -> database alias holding it (workflow_delivery.routing).
    "COMMUNITY_DATABASES": {},
}


class AppSettings:
    """Each setting is looked up once and then remembered until a ``setting_changed``
    signal (``override_settings``) names one of ours: an unset setting otherwise costs
    Django a failed attribute lookup on every read, twice per claim."""

    prefix = "WORKFLOW_DELIVERY_"

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        # Remembered as an instance attribute: the next read does not come here.
        value = self.__dict__[name] = getattr(settings, self.prefix + name, DEFAULTS[name])
        return value

    def forget(self, **kwargs: Any) -> None:
        if kwargs.get("setting", "").startswith(self.prefix):
            self.__dict__.clear()


app_settings = AppSettings()
setting_changed.connect(app_settings.forget, dispatch_uid="workflow_delivery.conf")


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
