"""The agent's side: a loop that claims, runs a handler under a heartbeat, and settles.

``Consumer(community_id, targets, handler)`` runs ``concurrency`` worker threads, each
claiming the oldest pending delivery of its targets on a connection of its own and
calling ``handler(record, lease, context)``. A handler that returns settles the
delivery ``finished``. One that raises gives it back to be retried
(``services.retry_delivery``): pending again after a backoff, its error kept, until
it has used ``WORKFLOW_DELIVERY_MAX_ATTEMPTS`` claims, when it settles ``failed``. A
handler that raises ``PermanentFailure`` settles it ``failed`` at once, its error
kept. A lease lost meanwhile settles nothing (the delivery is someone else's now).
``context.message`` is the delivery's message (its text or JSON value, read when first
asked for). ``context.lost`` is set as soon as the consumer learns the lease is gone,
and ``context.holding()`` gives the handler lease-fenced writes (see
``services.holding``).

Waking: with ``listen`` (by default when ``WORKFLOW_DELIVERY_NOTIFY`` is on, as it is
by default) the main thread listens for the producer's notifications (``wakeups``).
A worker that finds nothing registers the consumer's targets as idle
(``services.register_idle``, naming the listening session) while the session listens,
polls once more, and only then waits: the next commit to one of them notifies, and the
main thread wakes the idle workers for a hint naming one of its targets. A waiting
worker also polls every ``poll_interval`` seconds, which is what makes a missed or
dropped notification, or none at all, harmless. A heartbeat thread renews every in-flight
lease each third of the lease, on its own connection, with a short
``lock_timeout``: a renew that meets the handler's own open ``holding()`` block is
"busy" and tried again shortly, never a lost lease.

Stopping (``stop()``, or SIGTERM/SIGINT through the command): no new claims; in-flight
handlers get ``grace_seconds`` to finish and settle; leases still held after that are
released (back to pending at once, fence bumped) so another consumer takes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from . import services
from .conf import app_settings
from .errors import CONNECTION_ERRORS, is_connection_lost
from .exceptions import DeliveryTimeout, LeaseNotLive, ProtocolError, WorkflowDeliveryError
from .models import CommunityAgent
from .protocol import (
    AlreadyTerminal,
    DeliveryRecord,
    Exhausted,
    Lease,
    LeaseLost,
    MessageEvent,
    Outcome,
    Renewed,
    Retried,
    Settled,
    as_uuid,
)
from .services.holder import checked_lease_seconds, renew_waiting_at_most
from .validation import checked_public_keys, is_number, is_whole_number
from .wakeups import WakeListener
from .wakeups import available as wakeups_available

__all__ = [
    "Consumer",
    "ConsumerStats",
    "DeliveryContext",
    "GiveBack",
    "Handler",
    "PermanentFailure",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 8
DEFAULT_POLL_INTERVAL = 2.0
DEFAULT_GRACE_SECONDS = 10.0
# How often the main thread looks at the stop flag while no notification arrives.
_LISTEN_SLICE = 0.25
_MAX_BACKOFF = 5.0


class PermanentFailure(Exception):
    """Raised by a handler: the delivery cannot succeed, however often it is tried.
    The consumer settles it ``failed`` at once, with this error (and what it was
    raised from) kept as its last error, instead of retrying it."""


class GiveBack(Exception):
    """Raised by a handler that stops without a verdict (the consumer is stopping):
    the lease is released at once, the delivery pending again, no attempt counted
    as failed."""


@dataclass
class ConsumerStats:
    """Counts since the consumer started; read them after ``run`` or in ``on_progress``.
    ``retried``: handler failures given back to be tried again (a delivery that had
    used every attempt counts as ``failed`` instead)."""

    claimed: int = 0
    finished: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    renewed: int = 0
    renew_busy: int = 0
    connection_errors: int = 0
    retried: int = 0

    def line(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


class DeliveryContext:
    """What a handler gets besides the record and the lease."""

    def __init__(self, consumer: Consumer, record: DeliveryRecord, lease: Lease) -> None:
        self.record = record
        self.lease = lease
        #: Set once the consumer knows the lease is gone (reaped, released,
        #: superseded): the handler should stop, nothing it settles will count.
        self.lost = threading.Event()
        #: Set when the consumer is stopping: a long handler may wind down early.
        self.stopping = consumer._stopping
        self.settled: Settled | None = None
        #: Callables the consumer runs in the transaction of its settle of this
        #: delivery (finish, fail or retry), right after it and only if it counted,
        #: each given the result (``Settled``, ``Retried`` or ``Exhausted``): their
        #: writes commit with the settle or not at all. A lost lease runs none.
        self.with_settle: list[Callable[[Settled | Retried | Exhausted], None]] = []
        self._consumer = consumer
        self._message: MessageEvent | None = None
        self._message_read = False

    @property
    def message(self) -> MessageEvent | None:
        """The message the delivery carries (``content`` its text or its JSON value,
        by ``content_kind``), read on first use; None if its event is not stored."""
        if not self._message_read:
            found = services.message_events(
                self.record.binding.community_id, [self.record], using=self._consumer.using
            )
            self._message, self._message_read = found.get(self.record.id), True
        return self._message

    @contextmanager
    def holding(self) -> Iterator[services.Held]:
        """``services.holding`` for this lease, renewed first so the block starts with
        a whole lease (the heartbeat cannot renew while the block holds the row).
        ``LeaseNotLive`` if the lease is gone; ``lost`` is then set."""
        consumer = self._consumer
        if self.lost.is_set():
            raise LeaseNotLive(self.lease)
        renewed = services.renew_delivery(
            self.lease, lease_seconds=consumer.lease_seconds, using=consumer.using
        )
        if isinstance(renewed, LeaseLost):
            self.lost.set()
            raise LeaseNotLive(self.lease)
        try:
            with services.holding(self.lease, using=consumer.using) as held:
                yield held
        except LeaseNotLive:
            self.lost.set()
            raise
        if held.settled is not None:
            self.settled = held.settled


Handler = Callable[[DeliveryRecord, Lease, DeliveryContext], Any]


def _discard_connection(using: str) -> None:
    """Drop this thread's connection so the next statement reconnects."""
    try:
        connections[using].close()
    except CONNECTION_ERRORS:
        logger.debug("closing a broken connection failed", exc_info=True)


def _recover(consumer: Consumer, exc: BaseException) -> None:
    """After a statement of the consumer's own failed with one of ``CONNECTION_ERRORS``,
    which it retries: a lost session (``is_connection_lost``) is counted and dropped so
    the next statement reconnects; any other (a deadlock, say) leaves the session be."""
    if is_connection_lost(exc, connections[consumer.using]):
        consumer._count("connection_errors")
        _discard_connection(consumer.using)


class _Heartbeat(threading.Thread):
    """Renews every tracked lease a third of the lease after its last renewal."""

    def __init__(self, consumer: Consumer) -> None:
        super().__init__(name="workflow-delivery-heartbeat", daemon=True)
        self.consumer = consumer
        self.interval = consumer.lease_seconds / 3
        # A renew waits at most this long for the row: longer means the handler's
        # own holding() block has it, and the next try comes soon after.
        self.lock_timeout_ms = max(50, min(500, int(consumer.lease_seconds * 100)))
        self._due: dict[UUID, tuple[DeliveryContext, float]] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._sleeping_until = 0.0

    def track(self, context: DeliveryContext) -> None:
        due = time.monotonic() + self.interval
        with self._cond:
            self._due[context.lease.delivery_id] = (context, due)
            # Wake the thread only when this beat comes before the one it sleeps
            # for: with deliveries in flight it rarely does, and a wake per claim
            # would cost a thread switch per delivery.
            if due < self._sleeping_until:
                self._cond.notify()

    def untrack(self, context: DeliveryContext) -> None:
        with self._cond:
            entry = self._due.get(context.lease.delivery_id)
            if entry is not None and entry[0] is context:
                del self._due[context.lease.delivery_id]

    def in_flight(self) -> list[DeliveryContext]:
        with self._cond:
            return [context for context, _ in self._due.values()]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _reschedule(self, context: DeliveryContext, after: float) -> None:
        with self._cond:
            entry = self._due.get(context.lease.delivery_id)
            if entry is not None and entry[0] is context:
                self._due[context.lease.delivery_id] = (context, time.monotonic() + after)

    def run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopped:
                        return
                    now = time.monotonic()
                    due = [context for context, at in self._due.values() if at <= now]
                    if not due:
                        wake = min((at for _, at in self._due.values()), default=now + 1.0)
                        self._sleeping_until = wake
                        self._cond.wait(timeout=max(0.0, wake - now))
                        self._sleeping_until = 0.0
                        continue
                for context in due:
                    self._beat(context)
        finally:
            connections[self.consumer.using].close()

    def _beat(self, context: DeliveryContext) -> None:
        consumer = self.consumer
        using = consumer.using
        try:
            # One statement in autocommit: its lock_timeout applies to this renew only.
            result = renew_waiting_at_most(
                context.lease,
                lease_seconds=consumer.lease_seconds,
                lock_timeout_ms=self.lock_timeout_ms,
                using=using,
            )
        except DeliveryTimeout:
            # lock_timeout: the handler's own holding() block has the row; not lost.
            consumer._count("renew_busy")
            logger.debug("renew of %s busy (row held); retrying", context.lease.delivery_id)
            self._reschedule(context, min(self.interval / 2, 1.0))
            return
        except CONNECTION_ERRORS as exc:
            logger.warning("heartbeat's renew failed (%s); retrying", exc)
            _recover(consumer, exc)
            self._reschedule(context, min(self.interval / 2, 1.0))
            return
        if isinstance(result, Renewed):
            consumer._count("renewed")
            self._reschedule(context, self.interval)
        else:
            logger.info("lease on %s lost", context.lease.delivery_id)
            context.lost.set()
            self.untrack(context)


class Consumer:
    """Claims and handles the deliveries of ``targets`` in one community until stopped.

    ``run()`` blocks until ``stop()`` is called (from any thread or a signal handler)
    or ``max_deliveries`` claims have been handled, and returns the counts.

    ``listen`` (default: whether ``WORKFLOW_DELIVERY_NOTIFY`` is on) opens a session
    that waits for the producers' wake-ups, and idle workers register for them;
    without it the workers only poll.
    """

    def __init__(
        self,
        community_id: UUID | str,
        targets: Iterable[bytes],
        handler: Handler,
        *,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
        concurrency: int = 1,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        using: str = DEFAULT_DB_ALIAS,
        max_deliveries: int | None = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        listen: bool | None = None,
        on_progress: Callable[[ConsumerStats], None] | None = None,
        roster_interval: float | None = None,
    ) -> None:
        self.community_id = as_uuid("community_id", community_id)
        if roster_interval is not None and not (is_number(roster_interval) and roster_interval > 0):
            raise ProtocolError(
                "roster_interval", f"must be a positive number: {roster_interval!r}"
            )
        #: With it, the targets are the roster's enabled agents, read again this often.
        self.roster_interval = roster_interval
        if roster_interval is not None:
            targets = self._enrolled_targets(using)
        self.targets = checked_public_keys("targets", targets)
        if not self.targets and roster_interval is None:
            raise ProtocolError("targets", "name at least one target")
        if not callable(handler):
            raise ProtocolError("handler", "must be callable")
        self.handler = handler
        # The same rule a claim applies, checked here rather than on the first claim.
        self.lease_seconds = checked_lease_seconds(lease_seconds)
        if not (is_whole_number(concurrency) and concurrency > 0):
            raise ProtocolError("concurrency", f"must be a positive whole number: {concurrency!r}")
        self.concurrency = concurrency
        if not (is_number(poll_interval) and poll_interval > 0):
            raise ProtocolError("poll_interval", f"must be a positive number: {poll_interval!r}")
        self.poll_interval = float(poll_interval)
        if max_deliveries is not None and not (
            is_whole_number(max_deliveries) and max_deliveries > 0
        ):
            raise ProtocolError(
                "max_deliveries", f"must be a positive whole number: {max_deliveries!r}"
            )
        self.max_deliveries = max_deliveries
        if not (is_number(grace_seconds) and grace_seconds >= 0):
            raise ProtocolError("grace_seconds", f"must be a number >= 0: {grace_seconds!r}")
        self.grace_seconds = float(grace_seconds)
        self.using = using
        if listen is not None and not isinstance(listen, bool):
            raise ProtocolError("listen", f"must be True, False or None: {listen!r}")
        # Producers that send no wake-ups leave a listening session nothing to hear.
        self.listen = app_settings.NOTIFY is True if listen is None else listen
        self.on_progress = on_progress
        self.stats = ConsumerStats()
        self._target_set = frozenset(self.targets)
        self._stats_lock = threading.Lock()
        self._stopping = threading.Event()
        # Idle workers sleep here; ``_wake_seq`` moves on every wake, so a wake that
        # comes between a worker's miss and its wait is not lost.
        self._wake = threading.Condition()
        self._wake_seq = 0
        self._reserved = 0
        #: Set once the wake-up session listens (observers: tests, benchmarks). Never
        #: set without one (``listen=False``, or no psycopg 3: ``wakeups.available()``).
        self.listening = threading.Event()
        # Set while the session listens: only then may a worker register as idle, since
        # a wake-up sent to nobody would consume the registration for nothing.
        self._heard = threading.Event()
        # The wake-up session, whose ``session`` a registration names as its waiter.
        self._listener: WakeListener | None = None

    def _enrolled_targets(self, using: str) -> list[bytes]:
        rows = CommunityAgent.objects.using(using).filter(
            community_id=self.community_id, enabled=True
        )
        return [bytes(key) for key in rows.order_by("id").values_list("pubkey", flat=True)]

    def follow_roster(self) -> None:
        """Serve the roster's enabled agents as they are now: an enrolled (or
        reinstated) agent is claimed for from the next claim on, a revoked one no longer
        (its leases were released by its revocation, so its handlers see the lease lost)."""
        targets = self._enrolled_targets(self.using)
        if targets != self.targets:
            logger.info("roster: serving %s agents (was %s)", len(targets), len(self.targets))
            # One assignment each: a worker reads a whole list, the old or the new one.
            self.targets = targets
            self._target_set = frozenset(targets)
            self._wake_workers()

    # -- control -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; in-flight handlers get the grace period. Safe from any thread."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _count(self, name: str, by: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + by)

    def _wake_workers(self, count: int | None = None) -> None:
        with self._wake:
            self._wake_seq += 1
            if count is None:
                self._wake.notify_all()
            else:
                self._wake.notify(count)

    # -- main thread: listening, stopping ----------------------------------------

    def run(self, stop: Callable[[], bool] | None = None) -> ConsumerStats:
        """Run until stopped (``stop()``, ``stop`` returning true, e.g. a
        ``commandline.StopRequest``) or ``max_deliveries`` are handled."""
        heartbeat = _Heartbeat(self)
        self._heartbeat = heartbeat
        heartbeat.start()
        workers = [
            threading.Thread(
                target=self._work, args=(index,), name=f"workflow-delivery-worker-{index}"
            )
            for index in range(self.concurrency)
        ]
        # Daemon threads: a handler still running past the grace period must not keep
        # the process alive once its lease has been released.
        for worker in workers:
            worker.daemon = True
            worker.start()
        listener = None
        if self.listen:
            if wakeups_available():
                listener = WakeListener(self.using)
                self._listener = listener
            else:
                # On psycopg2 alone the workers poll; ``listening`` is never set.
                logger.warning("wake-ups need psycopg 3; polling every %s s", self.poll_interval)
        graceful = False
        try:
            self._listen(listener, workers, stop)
            graceful = True
        finally:
            self._stopping.set()
            self._wake_workers()
            if listener is not None:
                listener.close()
            grace = self.grace_seconds if graceful else 0.0
            self._wind_down(workers, heartbeat, grace, clean=graceful)
        return self.stats

    def _listen(
        self,
        listener: WakeListener | None,
        workers: list[threading.Thread],
        stop: Callable[[], bool] | None,
    ) -> None:
        if listener is not None:
            import psycopg  # there is a listener only where psycopg 3 is installed

            try:
                listener.connect()
                self.listening.set()
                self._heard.set()
                # A worker that missed before the session listened waits without a
                # registration: send it round again to register.
                self._wake_workers()
            except psycopg.OperationalError as exc:
                # Its own session, outside Django: psycopg's error, not Django's.
                # The next wait retries; until then the workers poll.
                logger.warning("cannot listen for wake-ups yet (%s); polling", exc)
        reconnects = 0
        last_progress = last_roster = time.monotonic()
        while not self._stopping.is_set() and any(worker.is_alive() for worker in workers):
            if stop is not None and stop():
                break
            if self.roster_interval is not None and (
                time.monotonic() - last_roster >= self.roster_interval
            ):
                last_roster = time.monotonic()
                try:
                    self.follow_roster()
                except CONNECTION_ERRORS as exc:
                    logger.warning("cannot read the roster (%s); trying again", exc)
                    _recover(self, exc)
            if listener is None:
                self._stopping.wait(_LISTEN_SLICE)
            else:
                hints = listener.wait(_LISTEN_SLICE)
                ours = sum(
                    1
                    for hint in hints
                    if hint.community_id == self.community_id
                    and hint.target_pubkey in self._target_set
                )
                if ours:
                    # One wake per idle target, however many rows were committed:
                    # every waiting worker looks, and those that miss register again.
                    self._wake_workers()
                if listener.connected:
                    self.listening.set()
                    if not self._heard.is_set():
                        # Listening again (or at last): idle workers register now.
                        self._heard.set()
                        self._wake_workers()
                else:
                    self._heard.clear()
                if listener.reconnects != reconnects:
                    # Whatever was sent while nobody listened is found by a poll now.
                    reconnects = listener.reconnects
                    self._wake_workers()
            if self.on_progress is not None and time.monotonic() - last_progress >= 1.0:
                last_progress = time.monotonic()
                self.on_progress(self.stats)

    def _wind_down(
        self, workers: list[threading.Thread], heartbeat: _Heartbeat, grace: float, *, clean: bool
    ) -> None:
        deadline = time.monotonic() + grace
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        # Past the grace period: hand the remaining leases back now rather than
        # leaving them to expire, and tell their handlers.
        for context in heartbeat.in_flight():
            context.lost.set()
            heartbeat.untrack(context)
            try:
                released = services.release_lease(context.lease, using=self.using)
            except CONNECTION_ERRORS as exc:
                logger.warning("could not release %s (%s)", context.lease.delivery_id, exc)
                _recover(self, exc)
                continue
            if released:
                self._count("released")
                logger.info("released %s still in flight at stop", context.lease.delivery_id)
        heartbeat.stop()
        heartbeat.join(5)
        if clean and not any(worker.is_alive() for worker in workers):
            # A clean stop: nothing of this consumer waits for a wake-up any more, so
            # the "why not delivered?" page must not show its targets as waited for.
            try:
                services.unregister_idle(self.community_id, self.targets, using=self.using)
            except (*CONNECTION_ERRORS, WorkflowDeliveryError) as exc:
                logger.warning("could not take back the idle registrations (%s)", exc)
        connections[self.using].close()
        if self.on_progress is not None:
            self.on_progress(self.stats)

    # -- workers ---------------------------------------------------------------------

    def _reserve(self) -> bool:
        with self._stats_lock:
            if self.max_deliveries is not None and self._reserved >= self.max_deliveries:
                return False
            self._reserved += 1
            return True

    def _unreserve(self) -> None:
        with self._stats_lock:
            self._reserved -= 1

    def _work(self, index: int) -> None:
        # Each worker thread has its own Django connection, closed when it ends.
        # Workers start at different targets and take them in turn (see _claim).
        turn = [index]
        backoff = 0.0
        # What the last settle claimed with it (reserved already), and whether it found
        # nothing for the only target: then a claim now would miss again.
        claimed: tuple[Lease, DeliveryRecord] | None = None
        missed = False
        try:
            while not self._stopping.is_set():
                if claimed is not None:
                    current, claimed = claimed, None
                    claimed = self._handle(*current, turn=turn)
                    missed = claimed is None and len(self.targets) == 1
                    continue
                if not self._reserve():
                    return
                with self._wake:
                    seen = self._wake_seq
                try:
                    claimed = None if missed else self._claim(turn)
                    missed = False
                    session = None if self._listener is None else self._listener.session
                    if claimed is None and self._heard.is_set() and session and self.targets:
                        # Registered while the session listens, a commit from now on
                        # wakes us; this poll finds one that came before. The
                        # registration names the listening session: while it lives,
                        # this consumer waits for the wake-up.
                        services.register_idle(
                            self.community_id, self.targets, session=session, using=self.using
                        )
                        claimed = self._claim(turn)
                except CONNECTION_ERRORS as exc:
                    self._unreserve()
                    backoff = min(_MAX_BACKOFF, backoff * 2 or 0.1)
                    logger.warning("claim failed (%s); trying again in %.1f s", exc, backoff)
                    _recover(self, exc)
                    self._stopping.wait(backoff)
                    continue
                except WorkflowDeliveryError as exc:
                    # e.g. the community is fenced: nothing can be claimed there now.
                    self._unreserve()
                    logger.error("claim refused: %s", exc)
                    self._stopping.wait(self.poll_interval)
                    continue
                backoff = 0.0
                if claimed is None:
                    self._unreserve()
                    with self._wake:
                        if self._wake_seq == seen and not self._stopping.is_set():
                            self._wake.wait(self.poll_interval)
                    continue
        finally:
            if claimed is not None:
                # Claimed with the last settle as the worker stopped: give it back.
                self._unreserve()
                try:
                    services.release_lease(claimed[0], using=self.using)
                except CONNECTION_ERRORS as exc:
                    logger.warning("could not release %s (%s)", claimed[0].delivery_id, exc)
            connections[self.using].close()

    def _claim(self, turn: list[int]) -> tuple[Lease, DeliveryRecord] | None:
        """One claim, trying each target at most once from ``turn[0]`` on; the next
        call starts after the target that gave a delivery. Round-robin keeps one
        target's backlog from starving the others, and an empty target costs a miss
        only when its turn comes, not before every claim."""
        targets = self.targets  # the roster may replace the list meanwhile
        count = len(targets)
        start = turn[0]
        for step in range(count):
            position = (start + step) % count
            claimed = services.claim_delivery(
                self.community_id,
                targets[position],
                lease_seconds=self.lease_seconds,
                using=self.using,
            )
            if claimed is not None:
                turn[0] = (position + 1) % count
                return claimed
        return None

    def _handle(
        self, lease: Lease, record: DeliveryRecord, *, turn: list[int] | None = None
    ) -> tuple[Lease, DeliveryRecord] | None:
        """Run the handler on a claimed delivery and settle it; the next delivery
        claimed with the settle (of the target whose turn it is), if any."""
        self._count("claimed")
        context = DeliveryContext(self, record, lease)
        self._heartbeat.track(context)
        outcome: Outcome | None = None
        error: Exception | None = None
        try:
            logger.debug("handling %s", lease.delivery_id)
            self.handler(record, lease, context)
            outcome = Outcome.FINISHED
        except LeaseNotLive:
            context.lost.set()
        except GiveBack:
            logger.info("handler gave %s back", lease.delivery_id)
        except PermanentFailure as exc:
            logger.warning(
                "handler failed delivery %s for good: %s", lease.delivery_id, exc, exc_info=True
            )
            outcome, error = Outcome.FAILED, exc
        except Exception as exc:
            if is_connection_lost(exc, connections[self.using]):
                # Not the handler's verdict on the delivery: give it back to be retried.
                logger.warning("handler lost its connection on %s (%s)", lease.delivery_id, exc)
                _discard_connection(self.using)
            else:
                # A timeout, a deadlock or any other error is the handler failing.
                logger.exception("handler raised on delivery %s", lease.delivery_id)
                error = exc
        finally:
            self._heartbeat.untrack(context)
        if context.settled is not None:
            self._count(context.settled.outcome.value)
        elif context.lost.is_set():
            self._count("lost")
        elif outcome is None and error is not None:
            self._retry(context, error)
        elif outcome is None:
            self._give_back(context)
        else:
            return self._settle(context, outcome, error, turn=turn)
        return None

    def _retrying(self, action: Callable[[], Any], context: DeliveryContext) -> Any:
        """``action()``, retried after a lost connection for as long as the lease
        could still be live; None if it never got through."""
        deadline = time.monotonic() + self.lease_seconds
        backoff = 0.0
        while True:
            try:
                return action()
            except CONNECTION_ERRORS as exc:
                _recover(self, exc)
                backoff = min(_MAX_BACKOFF, backoff * 2 or 0.1)
                if time.monotonic() + backoff > deadline:
                    logger.warning("gave up on %s (%s)", context.lease.delivery_id, exc)
                    return None
                time.sleep(backoff)

    def _settle(
        self,
        context: DeliveryContext,
        outcome: Outcome,
        error: Exception | None = None,
        *,
        turn: list[int] | None = None,
    ) -> tuple[Lease, DeliveryRecord] | None:
        """Settle the delivery; with room for another (``turn`` given, a target to
        claim for, not stopping, under ``max_deliveries``), claim the next one in the
        same statement and return it."""
        claimed = None
        targets = self.targets  # the roster may replace the list meanwhile
        if turn is not None and targets and not self._stopping.is_set() and self._reserve():
            claimed, result = self._settle_and_claim(context, outcome, error, turn, targets)
        else:
            result = self._finish(context, outcome, error)
        if isinstance(result, Settled):
            self._count(result.outcome.value)
        elif isinstance(result, AlreadyTerminal):
            # A retry after a settle whose answer was lost with the connection.
            self._count(result.status.value)
        else:
            context.lost.set()
            self._count("lost")
        return claimed

    def _finish(self, context: DeliveryContext, outcome: Outcome, error: Exception | None) -> Any:
        """The settle alone, retried after a lost connection while the lease may live."""
        return self._retrying(
            lambda: self._with_effects(
                context,
                lambda: services.finish_delivery(
                    context.lease, outcome, error=error, using=self.using
                ),
            ),
            context,
        )

    def _with_effects(
        self,
        context: DeliveryContext,
        settle: Callable[[], Any],
        result_of: Callable[[Any], Any] = lambda answer: answer,
    ) -> Any:
        """``settle()``, and then the context's ``with_settle`` effects in the same
        transaction if it counted (``result_of`` finds the result in its answer)."""
        if not context.with_settle:
            return settle()
        with transaction.atomic(using=self.using):
            answer = settle()
            result = result_of(answer)
            if isinstance(result, Settled | Retried | Exhausted):
                for effect in context.with_settle:
                    effect(result)
        return answer

    def _settle_and_claim(
        self,
        context: DeliveryContext,
        outcome: Outcome,
        error: Exception | None,
        turn: list[int],
        targets: list[bytes],
    ) -> tuple[tuple[Lease, DeliveryRecord] | None, Any]:
        """``finish_and_claim_next`` for the target of ``targets`` whose turn it is,
        with one claim reserved; a retry after a lost connection only settles (the
        first answer may have claimed a delivery already, which its lease's end hands
        back)."""
        position = turn[0] % len(targets)
        try:
            answer = self._with_effects(
                context,
                lambda: services.finish_and_claim_next(
                    context.lease,
                    outcome,
                    error=error,
                    target_pubkey=targets[position],
                    lease_seconds=self.lease_seconds,
                    using=self.using,
                ),
                lambda answer: answer.result,
            )
        except CONNECTION_ERRORS as exc:
            self._unreserve()
            _recover(self, exc)
            return None, self._finish(context, outcome, error)
        except BaseException:
            self._unreserve()
            raise
        # The next claim starts after this target either way: it gave one, or none.
        turn[0] = (position + 1) % len(targets)
        if answer.next is None:
            self._unreserve()
        return answer.next, answer.result

    def _retry(self, context: DeliveryContext, error: Exception) -> None:
        result = self._retrying(
            lambda: self._with_effects(
                context,
                lambda: services.retry_delivery(context.lease, error=error, using=self.using),
            ),
            context,
        )
        if isinstance(result, Retried):
            self._count("retried")
            logger.info(
                "delivery %s will be retried at %s (attempt %s failed)",
                context.lease.delivery_id,
                result.available_at,
                result.attempts,
            )
        elif isinstance(result, Exhausted):
            self._count("failed")
            logger.warning(
                "delivery %s failed: all %s attempts used",
                context.lease.delivery_id,
                result.attempts,
            )
        else:
            # A retry whose first answer was lost with the connection lands here too:
            # its generation was bumped, so the lease is gone either way.
            context.lost.set()
            self._count("lost")

    def _give_back(self, context: DeliveryContext) -> None:
        released = self._retrying(
            lambda: services.release_lease(context.lease, using=self.using), context
        )
        self._count("released" if released else "lost")
