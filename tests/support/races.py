"""Second Django connections on threads of their own, driven one call at a time from the test,
for the tests that race holders, producers, reapers and purges step by step."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from workflow_delivery.models import WorkflowAgentDelivery

GIVE_UP_SECONDS = 120
LOCK_TIMEOUT = "10s"


def run_together(parties: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(index)`` on ``parties`` threads released at once by a barrier.
    Each thread has its own Django connection and closes it when done."""
    barrier = threading.Barrier(parties, timeout=30)

    def party(index: int) -> Any:
        try:
            barrier.wait()
            return work(index)
        finally:
            close_connection()

    with ThreadPoolExecutor(max_workers=parties) as pool:
        futures = [pool.submit(party, index) for index in range(parties)]
        return [future.result(timeout=GIVE_UP_SECONDS + 30) for future in futures]


class Session:
    """A second connection, driven one call at a time from the test.

    Every call runs on one dedicated thread, so every call uses that thread's own
    Django connection; ``close()`` closes it there.
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1)
        self.call(limit_lock_waits)

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        return self._thread.submit(function, *args)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        return self.submit(function, *args).result(timeout=30)

    def close(self) -> None:
        try:
            self.call(close_connection)
        finally:
            self._thread.shutdown()


def close_connection() -> None:
    """Close the calling thread's connection (``connection`` resolves per thread)."""
    connection.close()


def scalar(statement: str, params: list | None = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])
        return cursor.fetchone()[0]


def begin() -> datetime:
    """Open a transaction on this thread's connection; return its now()."""
    transaction.set_autocommit(False)
    return scalar("SELECT now()")


def commit() -> None:
    transaction.commit()
    transaction.set_autocommit(True)


def limit_lock_waits() -> None:
    """A statement that waits for a lock it should have skipped fails instead of hanging."""
    scalar("SELECT set_config('lock_timeout', %s, false)", [LOCK_TIMEOUT])


def state(delivery_id: uuid.UUID) -> dict:
    return WorkflowAgentDelivery.objects.values("status", "lease_generation").get(pk=delivery_id)
