"""The app's settings, prefixed ``WORKFLOW_DELIVERY_``, read on first access and again
after every ``override_settings`` change of one of them."""

from __future__ import annotations

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
    # large backlog leaves most of the database to live holders.
    "REAP_YIELD_RATIO": 4.0,
    "PREPARED_STATEMENTS": True,
    # The agent HTTP API (workflow_delivery.api).
    "API_ORIGIN": None,
    "API_MAX_CLOCK_SKEW_SECONDS": 60,
    "API_MAX_BODY_BYTES": 65536,
    "API_MAX_WAIT_SECONDS": 60,
    # Waits and waiting claims one process holds; more are answered 503. From
    # bench/api.py --capacity: one uvicorn worker held 10,000, its wake-ups prompt
    # up to 5,000 on a loaded 2-core machine (each waiter asks again once a minute).
    "API_MAX_WAITERS": 5000,
    # The agent API's synchronous requests one community may have in flight in a
    # process served by api.asgi's handler; None: one less than its threads (at least 1).
    "API_MAX_IN_FLIGHT_PER_COMMUNITY": None,
    # How long a request over that bound waits (on the event loop) before its 503.
    "API_IN_FLIGHT_WAIT_SECONDS": 5.0,
    "API_REPLAY_PRUNE_INTERVAL_SECONDS": 60.0,
    # With NOTIFY off, a process looks for every waiter's claimable deliveries (one
    # query for all of them) this often.
    "API_WAIT_POLL_SECONDS": 2.0,
    # With NOTIFY on, the safety poll behind the wake-ups: the process's wake listener
    # looks for every waiter's claimable deliveries in one query about this often
    # (jittered by a quarter either way), so a notification missed is found.
    "API_WAIT_SWEEP_SECONDS": 15.0,
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
    # The same rest for retention: shorter than the reaper's, as pruning runs on a
    # schedule rather than to clear an outage's backlog.
    "PRUNE_YIELD_RATIO": 1.0,
    # Rows one transaction of a community's purge deletes at most: the exclusive
    # deletion lock is held for one such batch at a time.
    "PURGE_BATCH_SIZE": 2000,
    # Seconds one batch of a purge aims to hold the exclusive deletion lock: the next
    # batch's size follows the last one's time (0: every batch PURGE_BATCH_SIZE rows).
    "PURGE_BATCH_SECONDS": 0.2,
    # send_message's bounds on a new message: its content's encoded size (UTF-8; a JSON
    # value's compact encoding), the number of the caller's tags, and their encoded
    # size (UTF-8 of their compact JSON), each checked before anything is stored.
    "MAX_MESSAGE_CONTENT_BYTES": 1048576,
    "MAX_MESSAGE_TAGS": 1000,
    "MAX_MESSAGE_TAGS_BYTES": 65536,
    # Record each delivery's transitions (the timeline trigger) for the app's sessions.
    "TIMELINE": True,
    # The ACP runtime (workflow_delivery.acp): what an agent's turn may say that is
    # kept (bytes of its streamed text), the largest reply its MCP tool accepts, and
    # the tool kinds or titles whose permission requests are allowed (others denied).
    "ACP_TRANSCRIPT_BYTES": 65536,
    "ACP_REPLY_BYTES": 65536,
    "ACP_ALLOW_PERMISSIONS": (),
    # Community id (text) -> database alias holding it (workflow_delivery.routing).
    "COMMUNITY_DATABASES": {},
}


# Read as flags: a string such as "false" would be truthy, so only a real bool is taken.
FLAGS = frozenset({"NOTIFY", "NOTIFY_IN_TRANSACTION"})


class AppSettings:
    """Each setting is looked up once and then remembered until a ``setting_changed``
    signal (``override_settings``) names one of ours: an unset setting otherwise costs
    Django a failed attribute lookup on every read, twice per claim."""

    prefix = "WORKFLOW_DELIVERY_"

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        value = getattr(settings, self.prefix + name, DEFAULTS[name])
        if name in FLAGS and not isinstance(value, bool):
            raise WorkflowDeliveryConfigurationError(
                f"{self.prefix}{name} must be True or False, got {value!r}."
            )
        # Remembered as an instance attribute: the next read does not come here.
        self.__dict__[name] = value
        return value

    def forget(self, **kwargs: Any) -> None:
        if kwargs.get("setting", "").startswith(self.prefix):
            self.__dict__.clear()


app_settings = AppSettings()
setting_changed.connect(app_settings.forget, dispatch_uid="workflow_delivery.conf")
