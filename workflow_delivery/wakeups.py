"""Wake-ups: an idle consumer registers, the producer's commit notifies it once.

A consumer (or an API ``wait``) that finds nothing to claim LISTENs on
``WAKE_CHANNEL``, registers its (community, target) pairs as idle
(``services.register_idle``, a row each in a small unlogged table), polls once more
and then waits. With ``WORKFLOW_DELIVERY_NOTIFY`` on (the default), the statement that
inserts a producer's deliveries also deletes the registrations of the targets it
created rows for and sends one notification per target it deleted: by default from the
inserting statement itself, which PostgreSQL delivers with the commit, or, with
``WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION = False``, right after the commit
(``on_commit``, in a statement of its own). A target's idle episode is announced once,
however many rows land on it; a producer whose targets have no idle consumer sends
nothing, so its commit never takes PostgreSQL's notify lock. A rolled-back commit
sends nothing and keeps the registrations; a skipped duplicate creates no row and
wakes nobody. The payload is identifiers only
(``<community uuid>:<target hex>:<delivery uuid>``, one of the new rows), never content.

A wake is an accelerator: the claim it prompts goes through the ordinary claim path,
and polling stays the source of truth. A wake can be missed, and is then found by the
consumer's next poll: when the producer's inserting statement began before the
registration committed and its commit lands after the consumer's last look (with the
in-transaction default; after the commit the registry is read only once the rows are
visible), when the listening session was lost (a listener that reconnects sends its
waiters to poll), or when the producer died between its commit and an after-commit
send.

The channel and the payload's format are the store's (``store.wake``); this module is
the listening side. ``WakeListener`` holds its own psycopg 3 connection, outside Django's connection
handling: ``LISTEN`` needs a session that stays open and idle between waits, which a
pooled or per-request connection is not. Its ``session`` (the backend's pid and start)
is what a registration names as the one waiting for the wake-up, so the admin can tell
a registration whose listener is gone from one still waited for.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from .store.wake import WAKE_CHANNEL, ListenerSession, WakeNotice, parse_wake

# The calling session's own row: every role sees all of it.
_OWN_SESSION = (
    "SELECT a.pid, a.backend_start"
    " FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a"
)

__all__ = ["WakeListener", "available", "connection_params"]

logger = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Whether ``WakeListener`` can run here: it needs psycopg 3. A host on psycopg2
    alone still sends wake-ups but cannot listen for them: its consumers poll."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    return True


def connection_params(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to the database of Django's ``using``
    alias, without Django's own cursor and adapter machinery."""
    params = dict(connections[using].get_connection_params())
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    params.setdefault("application_name", "workflow_delivery wake listener")
    return params


class WakeListener:
    """``LISTEN`` on a connection of its own; ``wait(timeout)`` returns the hints that
    arrived, or an empty list after ``timeout`` seconds.

    A lost connection is reopened on the next ``wait`` with a growing pause (up to
    ``max_backoff`` seconds). Notifications sent while no session listened are gone,
    so ``wait`` returns at once, empty, after every reconnect: the caller should poll
    then. Not thread-safe: one listener per waiting thread.
    """

    def __init__(
        self,
        using: str = DEFAULT_DB_ALIAS,
        *,
        channel: str = WAKE_CHANNEL,
        max_backoff: float = 5.0,
    ) -> None:
        self.using = using
        self.channel = channel
        self.max_backoff = max_backoff
        self.reconnects = 0
        self._conn: Any = None
        self._session: ListenerSession | None = None
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._ever_connected = False

    def __enter__(self) -> WakeListener:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def session(self) -> ListenerSession | None:
        """The listening session (safe to read from any thread), or None while there is
        none: what an idle registration names as the session its wake-up goes to."""
        return self._session

    def connect(self) -> None:
        """Open the session and ``LISTEN``; raises ``psycopg.OperationalError`` if the
        server cannot be reached."""
        import psycopg
        from psycopg import sql

        self.close()
        # Autocommit: LISTEN takes effect at once, and an idle session holds no
        # transaction open (no snapshot, nothing for vacuum to wait on).
        conn = psycopg.connect(autocommit=True, **connection_params(self.using))
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            pid, backend_start = conn.execute(_OWN_SESSION).fetchone()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._session = ListenerSession(pid, backend_start)
        if self._ever_connected:
            self.reconnects += 1
        self._ever_connected = True
        self._backoff = 0.0

    def close(self) -> None:
        self._session = None
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except Exception:  # closing a broken session must not raise
                logger.debug("closing the wake listener's connection failed", exc_info=True)

    def _lost(self, exc: BaseException) -> None:
        logger.warning("wake listener lost its connection (%s); polling until it is back", exc)
        self.close()
        self._backoff = min(self.max_backoff, max(0.1, self._backoff * 2))
        self._next_attempt = time.monotonic() + self._backoff

    def _reconnect(self, timeout: float) -> bool:
        """Try to reopen the session, waiting at most ``timeout`` for the backoff."""
        import psycopg

        pause = self._next_attempt - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, max(0.0, timeout)))
            if self._next_attempt > time.monotonic():
                return False
        try:
            self.connect()
        except psycopg.OperationalError as exc:
            self._lost(exc)
            return False
        return True

    def wait(self, timeout: float) -> list[WakeNotice]:
        """Hints that arrive within ``timeout`` seconds, as soon as the first does.
        Malformed payloads are dropped. Empty after a timeout or a reconnect."""
        import psycopg

        if not self.connected:
            # Either way the caller polls next: anything sent meanwhile was missed.
            self._reconnect(timeout)
            return []
        hints: list[WakeNotice] = []
        try:
            # Each generator is run to its end: it stops only after yielding every
            # notification of the packet it read, so none is dropped half-read.
            received = list(self._conn.notifies(timeout=max(0.0, timeout), stop_after=1))
            if received:
                received += list(self._conn.notifies(timeout=0))
        except psycopg.OperationalError as exc:
            self._lost(exc)
            return []
        for notify in received:
            hint = parse_wake(notify.payload)
            if hint is None:
                logger.debug("ignoring a malformed wake payload %r", notify.payload)
            else:
                hints.append(hint)
        return hints
