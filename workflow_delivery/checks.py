"""System checks with stable ids; tests compare against the message constants."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections

from .conf import DEFAULTS, app_settings
from .validation import (
    AGENT_TURN_TEXT_MAX_BYTES,
    LEASE_SECONDS_BOUND,
    is_delay_seconds,
    is_number,
    is_transcript_bytes,
    is_whole_number,
    is_yield_ratio,
    parse_duration,
)

# The oldest server CI runs the suite on (the README's support table).
MINIMUM_POSTGRESQL = (14,)
E001_MSG = "workflow_delivery needs PostgreSQL {needed} or newer: database {alias!r} {found}."
E002_MSG = "WORKFLOW_DELIVERY_{name} must be a positive whole number, got {value!r}."
E003_MSG = (
    "WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS ({default}) exceeds "
    "WORKFLOW_DELIVERY_MAX_LEASE_SECONDS ({maximum})."
)
E004_MSG = (
    "WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS must be a positive finite number, got {value!r}."
)
E010_MSG = "WORKFLOW_DELIVERY_{name} must be a positive finite number, got {value!r}."
E005_MSG = "WORKFLOW_DELIVERY_{name} must be a number from 0 to 100, got {value!r}."
E006_MSG = (
    "WORKFLOW_DELIVERY_MAX_LEASE_SECONDS ({value}) exceeds {bound} (10 years), the longest "
    "lease the app hands out: a lease end must stay far inside PostgreSQL's timestamp range."
)
E008_MSG = "WORKFLOW_DELIVERY_MAX_ATTEMPTS must be None or a positive whole number, got {value!r}."
E022_MSG = (
    "WORKFLOW_DELIVERY_API_MAX_IN_FLIGHT_PER_COMMUNITY must be None or a positive whole "
    "number, got {value!r}."
)
E023_MSG = (
    "WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES must be a whole number of bytes from 0 to "
    "{bound} (the most a stored turn holds), got {value!r}."
)
E009_MSG = (
    "WORKFLOW_DELIVERY_RETENTION must be a duration such as 30d, 12h, 15m or 90s, got {value!r}."
)

E011_MSG = "WORKFLOW_DELIVERY_NOTIFY must be True or False, got {value!r}."
E012_MSG = "WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION must be True or False, got {value!r}."
E020_MSG = (
    "WORKFLOW_DELIVERY_{name} must be a number of seconds from 0 to {bound} (10 years), "
    "got {value!r}."
)
E021_MSG = (
    "WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS ({base}) exceeds "
    "WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS ({maximum})."
)


def _positive_int(value: Any) -> bool:
    return is_whole_number(value) and value > 0


def _needed() -> str:
    return ".".join(str(part) for part in MINIMUM_POSTGRESQL)


def _found_version(alias: str) -> tuple[int, ...] | None:
    """The server's (major, minor), or None when it cannot be asked right now."""
    try:
        number = connections[alias].pg_version
    except DatabaseError:
        # An unreachable server is the command's own error to report, not a check's.
        return None
    return (number // 10000, number % 10000)


@checks.register(checks.Tags.compatibility)
def check_postgresql(app_configs: Any = None, **kwargs: Any) -> list:
    # The backend's vendor is known without connecting; the server's version asks it.
    errors = []
    for alias in connections:
        vendor = connections[alias].vendor
        if vendor != "postgresql":
            found = f"uses the {vendor!r} backend"
        else:
            version = _found_version(alias)
            if version is None or version >= MINIMUM_POSTGRESQL:
                continue
            found = f"is PostgreSQL {version[0]}.{version[1]}"
        errors.append(
            checks.Error(
                E001_MSG.format(needed=_needed(), alias=alias, found=found),
                id="workflow_delivery.E001",
            )
        )
    return errors


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list:
    errors = []
    for name in (
        "DEFAULT_LEASE_SECONDS",
        "MAX_LEASE_SECONDS",
        "REAP_BATCH_SIZE",
        "PRUNE_BATCH_SIZE",
        "PURGE_BATCH_SIZE",
        "MAX_MESSAGE_CONTENT_BYTES",
        "MAX_MESSAGE_TAGS",
        "MAX_MESSAGE_TAGS_BYTES",
    ):
        value = getattr(app_settings, name)
        if not _positive_int(value):
            errors.append(
                checks.Error(E002_MSG.format(name=name, value=value), id="workflow_delivery.E002")
            )
    default, maximum = app_settings.DEFAULT_LEASE_SECONDS, app_settings.MAX_LEASE_SECONDS
    if _positive_int(maximum) and maximum > LEASE_SECONDS_BOUND:
        errors.append(
            checks.Error(
                E006_MSG.format(value=maximum, bound=LEASE_SECONDS_BOUND),
                id="workflow_delivery.E006",
            )
        )
    if _positive_int(default) and _positive_int(maximum) and default > maximum:
        errors.append(
            checks.Error(
                E003_MSG.format(default=default, maximum=maximum), id="workflow_delivery.E003"
            )
        )
    interval = app_settings.REAP_INTERVAL_SECONDS
    if not (is_number(interval) and interval > 0):
        errors.append(checks.Error(E004_MSG.format(value=interval), id="workflow_delivery.E004"))
    for name in ("API_WAIT_POLL_SECONDS", "API_WAIT_SWEEP_SECONDS"):
        seconds = getattr(app_settings, name)
        if not (is_number(seconds) and seconds > 0):
            message = E010_MSG.format(name=name, value=seconds)
            errors.append(checks.Error(message, id="workflow_delivery.E010"))
    for name in ("REAP_YIELD_RATIO", "PRUNE_YIELD_RATIO"):
        ratio = getattr(app_settings, name)
        if not is_yield_ratio(ratio):
            message = E005_MSG.format(name=name, value=ratio)
            errors.append(checks.Error(message, id="workflow_delivery.E005"))
    cap = app_settings.MAX_ATTEMPTS
    if cap is not None and not _positive_int(cap):
        errors.append(checks.Error(E008_MSG.format(value=cap), id="workflow_delivery.E008"))
    bound = app_settings.API_MAX_IN_FLIGHT_PER_COMMUNITY
    if bound is not None and not _positive_int(bound):
        errors.append(checks.Error(E022_MSG.format(value=bound), id="workflow_delivery.E022"))
    transcript = app_settings.ACP_TRANSCRIPT_BYTES
    if not is_transcript_bytes(transcript):
        message = E023_MSG.format(bound=AGENT_TURN_TEXT_MAX_BYTES, value=transcript)
        errors.append(checks.Error(message, id="workflow_delivery.E023"))
    backoff = {}
    for name in ("RETRY_BACKOFF_SECONDS", "RETRY_BACKOFF_MAX_SECONDS", "PURGE_BATCH_SECONDS"):
        value = backoff[name] = getattr(app_settings, name)
        if not is_delay_seconds(value):
            message = E020_MSG.format(name=name, bound=LEASE_SECONDS_BOUND, value=value)
            errors.append(checks.Error(message, id="workflow_delivery.E020"))
    base, most = backoff["RETRY_BACKOFF_SECONDS"], backoff["RETRY_BACKOFF_MAX_SECONDS"]
    if is_delay_seconds(base) and is_delay_seconds(most) and base > most:
        errors.append(
            checks.Error(E021_MSG.format(base=base, maximum=most), id="workflow_delivery.E021")
        )
    retention = app_settings.RETENTION
    try:
        parse_duration(retention)
    except ValueError:
        errors.append(checks.Error(E009_MSG.format(value=retention), id="workflow_delivery.E009"))
    # A string such as "false" would be truthy: only a real bool is accepted (read
    # here as set, since app_settings refuses such a value).
    for name, message, check_id in (
        ("NOTIFY", E011_MSG, "workflow_delivery.E011"),
        ("NOTIFY_IN_TRANSACTION", E012_MSG, "workflow_delivery.E012"),
    ):
        flag = getattr(settings, app_settings.prefix + name, DEFAULTS[name])
        if not isinstance(flag, bool):
            errors.append(checks.Error(message.format(value=flag), id=check_id))
    return errors
