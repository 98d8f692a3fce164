"""The app's settings, prefixed ``WORKFLOW_DELIVERY_``, read on first access and again
after every ``override_settings`` change of one of them."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

DEFAULTS: dict[str, Any] = {
    "DEFAULT_LEASE_SECONDS": 60,
    "MAX_LEASE_SECONDS": 605200,
    "REAP_BATCH_SIZE": 500,
    "REAP_INTERVAL_SECONDS": 5.0,
    "REAP_YIELD_RATIO": 1.0,
    "PREPARED_STATEMENTS": True,
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


def is_whole_number(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_yield_ratio(value: object) -> bool:
    """How long the reaper rests after a full batch, in multiples of that batch."""
    return is_number(value) and 0 <= value <= 100
