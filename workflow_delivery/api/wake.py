"""Wake-ups for ``GET v1/wait``: one LISTEN connection per process, fanned out to
every waiting request of that process.

A waiter costs a future, not a connection: the listener thread holds the only
connection that LISTENs (``wakeups.WakeListener``), and resolves the futures of the
(community, target) a notification names, on each waiter's own event loop. After a
lost and reopened session every waiter is answered empty, so its agent polls for
anything sent meanwhile. Producers notify only targets registered as idle: the view
registers its caller's (``services.register_idle``) once this hub listens, before its
last look for a pending delivery. A wake is an accelerator only: the agent still claims
through the ordinary path.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..store.wake import WakeNotice
from ..wakeups import WakeListener

_POLL_SECONDS = 0.5

Key = tuple[UUID, bytes]


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

    def dispatch(self, hint: WakeNotice) -> int:
        """Wake every waiter of the hint's community and target; returns how many."""
        with self._lock:
            waiters = self._waiters.pop((hint.community_id, hint.target_pubkey), set())
            self._count -= len(waiters)
        for waiter in waiters:
            waiter.resolve(hint.delivery_id)
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

    def _run(self) -> None:
        listener = WakeListener(self.using)
        reconnects = 0
        try:
            while not self._stop.is_set():
                hints = listener.wait(_POLL_SECONDS)
                if listener.connected:
                    self._listening.set()
                else:
                    self._listening.clear()
                if listener.reconnects != reconnects:
                    reconnects = listener.reconnects
                    self._wake_everyone()
                for hint in hints:
                    self.dispatch(hint)
        finally:
            self._listening.clear()
            listener.close()


hub = WakeHub()
