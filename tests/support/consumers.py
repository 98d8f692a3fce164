"""A consumer run on a thread of the test, a handler that records what it saw, and waits for
what the consumer does, for the tests of the consumer and of what it drives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connection

from tests.support import factories
from tests.support.sessions import other_sessions
from workflow_delivery import wakeups
from workflow_delivery.consumer import Consumer, ConsumerStats, DeliveryContext
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryRecord, DeliveryStatus, Lease


def status(delivery_id) -> DeliveryStatus:
    return DeliveryStatus(WorkflowAgentDelivery.objects.get(id=delivery_id).status)


class Running:
    """A consumer's ``run()`` on a thread of its own; stopped and joined on exit."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.stats: ConsumerStats | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.stats = self.consumer.run()
        finally:
            connection.close()

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.stop()
        self.join()

    def join(self, timeout: float = 20) -> ConsumerStats:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the consumer did not stop"
        assert self.stats is not None
        return self.stats


def eventually(check: Callable[[], Any], seconds: float = 5.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


class Recorder:
    """A handler that notes when it ran, and what it saw."""

    def __init__(self, body: Callable[[DeliveryRecord, Lease, DeliveryContext], Any] | None = None):
        self.body = body
        self.started: dict[Any, float] = {}
        self.seen: dict[str, Any] = {}
        self.entered = threading.Event()

    def __call__(self, record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
        self.started[record.id] = time.monotonic()
        self.entered.set()
        if self.body is not None:
            self.body(record, lease, context)


def started(consumer: Consumer) -> int:
    """Wait until ``consumer`` is up: listening with psycopg 3, and in any case with its
    worker's session open (on psycopg2 alone it polls and never listens). Returns how
    many sessions of its own it has open at least."""
    sessions = 1
    if consumer.listen and wakeups.available():
        assert consumer.listening.wait(5)
        sessions += 1
    assert eventually(lambda: other_sessions() >= sessions, 5)
    return sessions


def consumer_for(step: factories.Step, handler, **options: Any) -> Consumer:
    options.setdefault("lease_seconds", 2)
    options.setdefault("grace_seconds", 2)
    return Consumer(step.community.id, step.targets, handler, **options)
