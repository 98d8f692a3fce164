"""Wake-ups for ``GET v1/wait``: one LISTEN connection per process, fanned out to
every waiting request of that process.

A waiter costs a future, not a connection: the listener thread holds the only
connection that LISTENs, and resolves the futures of the (community, target) a
notification names, on each waiter's own event loop. Payloads follow the contract
of ``workflow_delivery_wake`` (``<community>:<target hex>:<delivery>``); a wake is an
accelerator only, the agent still claims through the ordinary path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections

logger = logging.getLogger(__name__)

WAKE_CHANNEL = "workflow_delivery_wake"
_PAYLOAD = re.compile(
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}):([0-9a-f]{64}):"
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
)
_RETRY_SECONDS = 1.0
_POLL_SECONDS = 0.5

Key = tuple[UUID, bytes]


def parse_payload(payload: str) -> tuple[UUID, bytes, UUID] | None:
    """(community, target, delivery) of a wake payload; None when malformed."""
    match = _PAYLOAD.fullmatch(payload) if isinstance(payload, str) else None
    if match is None:
        return None
    community, target, delivery = match.groups()
    return UUID(community), bytes.fromhex(target), UUID(delivery)


class _Waiter:
    __slots__ = ("future", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[UUID | None] = self.loop.create_future()

    def resolve(self, delivery_id: UUID | None) -> None:
        def settle() -> None:
            if not self.future.done():
                self.future.set_result(delivery_id)

        # A closed loop means the request is gone: nothing to wake.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(settle)


class WakeHub:
    """The waiters of one process and the listener thread that wakes them."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using
        self._lock = threading.Lock()
        self._waiters: dict[Key, set[_Waiter]] = {}
        self._count = 0
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._stop = threading.Event()

    @property
    def waiting(self) -> int:
        return self._count

    def register(self, community_id: UUID, target: bytes) -> _Waiter:
        """A waiter for the caller, on the running event loop."""
        waiter = _Waiter()
        with self._lock:
            self._waiters.setdefault((community_id, target), set()).add(waiter)
            self._count += 1
        return waiter

    def unregister(self, community_id: UUID, target: bytes, waiter: _Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get((community_id, target))
            if waiters is not None and waiter in waiters:
                waiters.discard(waiter)
                self._count -= 1
                if not waiters:
                    del self._waiters[(community_id, target)]

    def ensure_listening(self, timeout: float = 5.0) -> bool:
        """Start the listener if it is not running; True once it is LISTENing."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="workflow-delivery-wake", daemon=True
                )
                self._thread.start()
        return self._listening.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the listener and close its connection (tests; process shutdown)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._thread = None
        self._listening.clear()

    def dispatch(self, payload: str) -> int:
        """Wake every waiter the payload names; returns how many."""
        parsed = parse_payload(payload)
        if parsed is None:
            logger.warning("wake: ignoring a malformed payload on %s", WAKE_CHANNEL)
            return 0
        community_id, target, delivery_id = parsed
        with self._lock:
            waiters = self._waiters.pop((community_id, target), set())
            self._count -= len(waiters)
        for waiter in waiters:
            waiter.resolve(delivery_id)
        return len(waiters)

    def _wake_everyone(self) -> None:
        """After a lost connection notifications may have been missed: send every
        waiter back to poll (an empty answer) rather than let it wait in vain."""
        with self._lock:
            everyone = [waiter for waiters in self._waiters.values() for waiter in waiters]
            self._waiters.clear()
            self._count = 0
        for waiter in everyone:
            waiter.resolve(None)

    def _connect(self):
        wrapper = connections[self.using]
        # A connection of its own, outside Django's per-thread handling: it lives
        # as long as the listener, in autocommit so LISTEN takes effect at once.
        raw = wrapper.get_new_connection(wrapper.get_connection_params())
        raw.autocommit = True
        raw.execute(f"LISTEN {WAKE_CHANNEL}")
        return raw

    def _run(self) -> None:
        reconnecting = False
        while not self._stop.is_set():
            try:
                raw = self._connect()
            except Exception:
                logger.exception("wake: cannot LISTEN on %s; retrying", WAKE_CHANNEL)
                self._stop.wait(_RETRY_SECONDS)
                continue
            try:
                if reconnecting:
                    self._wake_everyone()
                self._listening.set()
                while not self._stop.is_set():
                    for notify in raw.notifies(timeout=_POLL_SECONDS):
                        self.dispatch(notify.payload)
            except Exception:
                logger.exception("wake: lost the LISTEN connection; reconnecting")
                reconnecting = True
            finally:
                self._listening.clear()
                try:
                    raw.close()
                except Exception:
                    logger.debug("wake: closing the listener connection failed", exc_info=True)
            if not self._stop.is_set():
                self._stop.wait(_RETRY_SECONDS)


hub = WakeHub()
