"""A community being deleted never holds up another: the API's admission only tries
the community's deletion lock, so while its executor holds the lock exclusively the
community's requests are answered 503 ``community_deleting`` at once, and another
community's requests are served as usual.

Each request runs in autocommit (the served path), as under a real server; the
executor is a second session holding the exclusive lock in an open transaction."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from tests.api.helpers import Agent, answer, rows
from tests.support.consumers import eventually
from tests.support.locks import key_of
from tests.support.second_session import other
from workflow_delivery.models import AgentRequestReplay

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("any_host")]


@pytest.fixture
def bounded_lock_waits():
    """A wait for a lock fails after 2 s on the test's session (the API's), so a
    request that would wait for the executor fails instead of hanging the test."""
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '2s'")
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


def test_a_community_being_deleted_is_answered_503_and_another_is_served(bounded_lock_waits):
    deleting, served = Agent(), Agent()
    client = Client()
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(deleting.step.community.id)])
        before = rows()
        for path, document in (
            ("v1/claim", {"lease_seconds": 30}),
            ("v1/claim/batch", {"limit": 5}),
            (f"v1/deliveries/{deleting.delivery.id}/renew", {"generation": 1}),
            (
                f"v1/deliveries/{deleting.delivery.id}/finish",
                {"generation": 1, "outcome": "failed"},
            ),
        ):
            refused = deleting.call(client, "POST", path, document)
            answer(refused, 503, "community_deleting")
            assert refused["Retry-After"] == "5"
        read = deleting.call(client, "GET", f"v1/deliveries/{deleting.delivery.id}")
        answer(read, 503, "community_deleting")
        assert rows() == before
        assert not AgentRequestReplay.objects.filter(
            community_id=deleting.step.community.id
        ).exists()
        claimed = answer(served.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
        assert claimed["delivery"]["id"] == str(served.delivery.id)
        executor.rollback()
    # The lock released, the community's requests are served again.
    claimed = answer(deleting.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    assert claimed["delivery"]["id"] == str(deleting.delivery.id)


def test_a_request_is_not_queued_behind_an_executor_waiting_for_the_lock(bounded_lock_waits):
    """A request of the community holds the shared lock; the executor queues for the
    exclusive one; a new request neither waits behind it nor overtakes it."""
    deleting = Agent()
    key = key_of(deleting.step.community.id)
    client = Client()
    with other() as reader, other() as executor:
        executor.execute("SET lock_timeout = '10s'")
        reader.execute("SELECT pg_advisory_xact_lock_shared(%s)", [key])
        queued = threading.Thread(
            target=executor.execute, args=("SELECT pg_advisory_xact_lock(%s)", [key])
        )
        queued.start()
        try:
            assert eventually(lambda: waiting_for_the_lock(key), 5)
            answer(deleting.call(client, "POST", "v1/claim"), 503, "community_deleting")
        finally:
            reader.rollback()
            queued.join(10)
            executor.rollback()


def waiting_for_the_lock(key: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND mode = 'ExclusiveLock' AND ((classid::bigint << 32) | objid::bigint) = %s)",
            [key],
        )
        return cursor.fetchone()[0]
