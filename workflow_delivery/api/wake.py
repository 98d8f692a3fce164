"""Wake-ups for ``GET v1/wait`` and waiting claims: one LISTEN connection per
process, fanned out to every waiting request of that process.

A waiter costs a future, not a connection: the listener thread holds the only
connection that LISTENs (``wakeups.WakeListener``), and resolves the futures of the
(community, target) a notification names, on each waiter's own event loop. After a
lost and reopened session every waiter is sent to look again (a ``wait`` is answered
empty, a waiting claim claims once more). Producers notify only targets registered as
idle: the view registers its caller's (``services.register_idle``) once this hub
listens, before its last look for a pending delivery, naming this hub's listening
session as the one its wake-up goes to (the request's own connection is closed while
it waits). A wake is an accelerator only: the agent still claims through the ordinary
path.

Behind the notifications, a safety poll that costs one query however many wait: about
every ``WORKFLOW_DELIVERY_API_WAIT_SWEEP_SECONDS`` (jittered) the listener's thread
looks for a claimable delivery of every waiting (community, target) at once and wakes
those that have one, so a notification missed (sent by a process with wake-ups off, or
consumed while its waiter was between looks) is found. With wake-ups off there is
nothing to listen for, and the same one query, made every
``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS`` by a thread of its own
(``ensure_sweeping``), is how every waiter of the process polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections
from django.db import Error as DatabaseError

from ..conf import app_settings
from ..models import WorkflowAgentDelivery
from ..store.wake import ListenerSession, WakeNotice
from ..wakeups import WakeListener

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.5
# Targets remembered as registered idle (``WakeHub.registering``) at most; past it the
# memory is cleared, and the next waits register theirs again.
_REGISTERED_BOUND = 100_000

Key = tuple[UUID, bytes]


class Waiter:
    """One waiting request: a future on its event loop, resolved from the listener's
    thread with the delivery a notification names (None: look again)."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # Made on another thread for a parked answer (``api.asgi.Parked``): creating a
        # future touches nothing of its loop's, and it is resolved only on the loop.
        self.loop = loop or asyncio.get_running_loop()
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
        self._waiters: dict[Key, set[Waiter]] = {}
        self._count = 0
        # Targets this process registered as idle whose registration no notification
        # has consumed since, while the listener's session has lasted (``registering``).
        self._registered: set[Key] = set()
        self._thread: threading.Thread | None = None
        self._sweeper: threading.Thread | None = None
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._listener: WakeListener | None = None

    @property
    def waiting(self) -> int:
        return self._count

    def register(
        self, community_id: UUID, target: bytes, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> Waiter:
        """A waiter for the caller, on ``loop`` (by default the running event loop)."""
        waiter = Waiter(loop)
        with self._lock:
            self._waiters.setdefault((community_id, target), set()).add(waiter)
            self._count += 1
        return waiter

    def registering(self, community_id: UUID, target: bytes) -> None:
        """Called before the caller's target is registered as idle: from then on,
        until a notification for it is dispatched or the listener's session is lost,
        ``registered`` says its registration stands and need not be made again. A
        registration removed without a notification (a ``Consumer`` of the same target
        stopping) is not seen here; its waiters are found by the safety poll."""
        with self._lock:
            if len(self._registered) >= _REGISTERED_BOUND:
                self._registered.clear()
            self._registered.add((community_id, target))

    def forget_registration(self, community_id: UUID, target: bytes) -> None:
        """The registration was not made (its statement failed)."""
        with self._lock:
            self._registered.discard((community_id, target))

    def registered(self, community_id: UUID, target: bytes) -> bool:
        """Whether the target's idle registration stands, as far as this process knows."""
        with self._lock:
            return (community_id, target) in self._registered

    def unregister(self, community_id: UUID, target: bytes, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get((community_id, target))
            if waiters is not None and waiter in waiters:
                waiters.discard(waiter)
                self._count -= 1
                if not waiters:
                    del self._waiters[(community_id, target)]

    @property
    def session(self) -> ListenerSession | None:
        """The session that LISTENs for this process's waiters, or None while none
        does: what the waiters' idle registrations name."""
        listener = self._listener
        return None if listener is None else listener.session

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

    def ensure_sweeping(self) -> None:
        """With wake-ups off (nothing to listen for): start the thread that looks for
        every waiter's claimable deliveries in one query every
        ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``, if it is not running. However
        many wait, the process then polls once an interval, not once a waiter."""
        with self._lock:
            if self._sweeper is None or not self._sweeper.is_alive():
                self._stop.clear()
                self._sweeper = threading.Thread(
                    target=self._sweep_run, name="workflow-delivery-wait-poll", daemon=True
                )
                self._sweeper.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the listener and the poll, and close their connections (tests; process
        shutdown)."""
        self._stop.set()
        for thread in (self._thread, self._sweeper):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._sweeper = None
        self._listening.clear()

    def dispatch(self, hint: WakeNotice) -> int:
        """Wake every waiter of the hint's community and target; returns how many."""
        return self._wake((hint.community_id, hint.target_pubkey), hint.delivery_id)

    def _wake(self, key: Key, delivery_id: UUID | None, *, consumed: bool = True) -> int:
        with self._lock:
            if consumed:
                # A notification consumes its target's registration.
                self._registered.discard(key)
            waiters = self._waiters.pop(key, set())
            self._count -= len(waiters)
        for waiter in waiters:
            waiter.resolve(delivery_id)
        return len(waiters)

    def sweep(self) -> int:
        """The safety poll: one query for the oldest claimable delivery of every
        waiting (community, target), and their waiters woken with it; returns how
        many waiters were woken."""
        with self._lock:
            keys = set(self._waiters)
        if not keys:
            return 0
        rows = (
            WorkflowAgentDelivery.objects.using(self.using)
            .claimable()
            .filter(
                community_id__in={community for community, _ in keys},
                target_pubkey__in={target for _, target in keys},
            )
            .order_by("created_at", "id")
            .values_list("community_id", "target_pubkey", "id")
        )
        found: dict[Key, UUID] = {}
        for community_id, target, delivery_id in rows:
            key = (community_id, bytes(target))
            if key in keys:
                found.setdefault(key, delivery_id)
        return sum(
            self._wake(key, delivery_id, consumed=False) for key, delivery_id in found.items()
        )

    def _wake_everyone(self) -> None:
        """After a lost connection notifications may have been missed: send every
        waiter back to poll (an empty answer) rather than let it wait in vain."""
        with self._lock:
            everyone = [waiter for waiters in self._waiters.values() for waiter in waiters]
            self._waiters.clear()
            # Notifications may have consumed registrations unseen.
            self._registered.clear()
            self._count = 0
        for waiter in everyone:
            waiter.resolve(None)

    def _run(self) -> None:
        listener = WakeListener(self.using)
        self._listener = listener
        reconnects = 0
        next_sweep = time.monotonic() + _sweep_interval()
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
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + _sweep_interval()
                    self._sweep_safely()
        finally:
            self._listening.clear()
            listener.close()

    def _sweep_run(self) -> None:
        while not self._stop.wait(app_settings.API_WAIT_POLL_SECONDS):
            self._sweep_safely()

    def _sweep_safely(self) -> None:
        """A sweep on a session of its own, closed after it (the process keeps no
        session for a query made once in seconds); its database error is logged and
        the next sweep left to look again."""
        try:
            self.sweep()
        except DatabaseError:
            logger.warning("the waiters' poll failed; the next one as planned", exc_info=True)
        finally:
            connections[self.using].close()


def _sweep_interval() -> float:
    """Seconds to the next safety poll: the setting, jittered by a quarter either way
    so the processes of a site do not all look at once."""
    return app_settings.API_WAIT_SWEEP_SECONDS * random.uniform(0.75, 1.25)


hub = WakeHub()
