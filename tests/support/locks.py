"""Lock waits and worker threads for the tests that race two sessions of the test database."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery

# A statement that waits on a lock it should have skipped fails within this instead
# of hanging the suite; a wait we expect to see shows well within it.
LOCK_TIMEOUT = "5s"
QUICK = 2.0  # seconds: "at once" under a loaded machine


def key_of(community_id: uuid.UUID) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wd_community_deletion_key(%s)", [community_id])
        return cursor.fetchone()[0]


def blocked(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", [pid]
        )
        return cursor.fetchone()[0]


def wait_until_blocked(pid: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not blocked(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"backend {pid} never waited for a lock")
        time.sleep(0.02)


def close_connection() -> None:
    """Close the calling thread's connection (``connection`` resolves per thread)."""
    connection.close()


class Worker:
    """Calls run on one thread with its own Django connection (closed at the end)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.pid = self.call(self._setup)

    @staticmethod
    def _setup() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, false)", [LOCK_TIMEOUT])
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    def submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any):
        return self._pool.submit(function, *args, **kwargs)

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.submit(function, *args, **kwargs).result(timeout=60)

    def close(self) -> None:
        try:
            self.call(close_connection)
        finally:
            self._pool.shutdown()


def expire_all(step: factories.Step) -> list[uuid.UUID]:
    """Claim every delivery of ``step`` and let the leases run out."""
    ids = [services.claim_delivery(step.community.id, t)[0].delivery_id for t in step.targets]
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = statement_timestamp() "
            "- interval '1 second' WHERE id = ANY(%s)",
            [ids],
        )
    return ids


def statuses(ids: list[uuid.UUID]) -> list[str]:
    rows = dict(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("id", "status"))
    return [rows[i] for i in ids]
