"""The agent API against a real server: uvicorn (ASGI) serving the demo project over
the test database, driven by ``AgentClient`` from this process.

Every setting is at its default, wake-ups included: a wait registers its caller as
idle and the producer's own commit notifies it. One test also sends a notification by
hand, for a delivery that is not pending, to prove the hint can only have come through
the channel.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import pytest
from django.db import connection

from tests.support import factories
from tests.support.agent_http import pubkey, secret, uvicorn_server
from workflow_delivery.api import nip98
from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import AgentApiError
from workflow_delivery.models import IdleWakeTarget
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    LeaseLost,
    Outcome,
    Renewed,
    Settled,
)
from workflow_delivery.services import commit_deliveries
from workflow_delivery.store.wake import WAKE_CHANNEL, format_wake

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    # A site on the defaults, wake-ups on: its waits rely on them and do not poll, so
    # a wait that ends before its poll could have is proof a wake-up ended it.
    with uvicorn_server() as url:
        yield url


def base_url(server: str, host: str) -> str:
    return f"http://{host}:{server.rsplit(':', 1)[1]}/agents/"


def notify(community_id, target: bytes, delivery_id) -> None:
    with connection.cursor() as cursor:
        payload = format_wake(community_id, target, delivery_id)
        cursor.execute("SELECT pg_notify(%s, %s)", [WAKE_CHANNEL, payload])


def commit_and_wake(step: factories.Step) -> list:
    """Commit one delivery per target of ``step``; the commit itself notifies."""
    deliveries = step.new_deliveries()
    created = commit_deliveries(step.community.id, step.created_at, deliveries)
    assert created == [item.id for item in deliveries]
    return deliveries


class Waiting(threading.Thread):
    """One agent blocked in ``wait`` on its own connection."""

    def __init__(self, url: str, key: bytes, timeout: int) -> None:
        super().__init__(daemon=True)
        self.client = AgentClient(url, key, timeout=10)
        self.timeout = timeout
        self.hint = None
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.hint = self.client.wait(timeout=self.timeout)
        except (OSError, ValueError, AgentApiError) as exc:
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - started
            self.client.close()


def test_whole_lifecycle_over_http_with_a_wake(server):
    owner = factories.community("localhost")
    key = secret()
    url = base_url(server, "localhost")
    step = factories.Step(owner=owner, targets=[pubkey(key)])
    first = factories.committed(step)[0]
    with AgentClient(url, key) as agent:
        lease, record = agent.claim(lease_seconds=2)
        assert record.id == first.id and record.binding == first.binding
        assert record.status == DeliveryStatus.CLAIMED and lease.generation == 1
        renewed = agent.renew(lease, lease_seconds=5)
        assert isinstance(renewed, Renewed) and renewed.lease_until > lease.lease_until
        assert agent.get(first.id).status == DeliveryStatus.CLAIMED
        assert agent.finish(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
        assert agent.finish(lease, Outcome.FAILED) == AlreadyTerminal(DeliveryStatus.FINISHED)
        assert agent.renew(lease) == LeaseLost()
        assert agent.claim() is None

        waiting = Waiting(url, key, timeout=20)
        waiting.start()
        time.sleep(1.0)
        second = commit_and_wake(factories.Step(owner=owner, targets=[pubkey(key)]))[0]
        waiting.join(25)
        assert waiting.error is None
        assert waiting.hint is not None and waiting.hint.delivery_id == second.id
        assert waiting.hint.target_pubkey == pubkey(key)
        assert waiting.elapsed < 15
        lease, record = agent.claim(delivery_id=waiting.hint.delivery_id, expected=second.binding)
        assert record.id == second.id
        assert agent.finish(lease, "failed") == Settled(Outcome.FAILED)


def test_with_every_setting_at_its_default_a_wait_is_woken_in_under_a_second(server):
    owner = factories.community("localhost")
    key = secret()
    factories.enroll(owner, [pubkey(key)])
    waiting = Waiting(base_url(server, "localhost"), key, timeout=50)
    waiting.start()
    # The wait registers its caller as idle once its process listens, then looks once
    # more; a commit from then on is announced by its producer.
    idle = IdleWakeTarget.objects.filter(community_id=owner.id, target_pubkey=pubkey(key))
    deadline = time.monotonic() + 15
    while not idle.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle.exists()
    time.sleep(0.2)
    committed_at = time.monotonic()
    (delivery,) = commit_and_wake(factories.Step(owner=owner, targets=[pubkey(key)]))
    waiting.join(50)
    woken_after = time.monotonic() - committed_at
    assert waiting.error is None
    assert waiting.hint is not None and waiting.hint.delivery_id == delivery.id
    assert woken_after < 1.0
    # The wake consumed the registration: the next commit sends nothing.
    assert not idle.exists()


def test_a_notification_reaches_its_waiter_and_no_other(server):
    """A wake for a delivery id that is not pending can only come from the channel."""
    owner = factories.community("localhost")
    url = base_url(server, "localhost")
    mine, other = secret(), secret()
    factories.enroll(owner, [pubkey(mine), pubkey(other)])
    waiting, bystander = Waiting(url, mine, timeout=20), Waiting(url, other, timeout=3)
    waiting.start()
    bystander.start()
    hinted = uuid.uuid4()
    deadline = time.monotonic() + 15
    # The listener may not have seen the waiter register yet: send until it answers.
    while waiting.is_alive() and time.monotonic() < deadline:
        notify(owner.id, pubkey(mine), hinted)
        waiting.join(0.5)
    bystander.join(10)
    assert waiting.error is None and waiting.hint is not None
    assert waiting.hint.delivery_id == hinted
    assert bystander.error is None and bystander.hint is None
    assert bystander.elapsed >= 2.5


def test_claims_are_served_while_100_agents_wait(server):
    owner = factories.community("localhost")
    url = base_url(server, "localhost")
    keys = [secret() for _ in range(100)]
    factories.enroll(owner, [pubkey(key) for key in keys])
    waiters = [Waiting(url, key, timeout=40) for key in keys]
    for waiter in waiters:
        waiter.start()
    time.sleep(2.0)

    worker = secret()
    cycles = 20
    for _ in range(cycles):
        factories.committed(factories.Step(owner=owner, targets=[pubkey(worker)]))
    latencies = []
    with AgentClient(url, worker) as agent:
        for _ in range(cycles):
            started = time.monotonic()
            lease, _record = agent.claim(lease_seconds=10)
            assert agent.finish(lease, "finished") == Settled(Outcome.FINISHED)
            latencies.append(time.monotonic() - started)
    assert all(waiter.is_alive() for waiter in waiters), "waits must still be waiting"
    print(
        f"\n100 waiters: {cycles} claim+finish cycles, mean {sum(latencies) / cycles * 1000:.1f}"
        f" ms, max {max(latencies) * 1000:.1f} ms"
    )
    # Generous for a shared 2-core machine; a blocked server would take the waits'
    # 40 s timeout per claim.
    assert max(latencies) < 10

    woken = commit_and_wake(factories.Step(owner=owner, targets=[pubkey(key) for key in keys]))
    started = time.monotonic()
    for waiter in waiters:
        waiter.join(max(0.1, 30 - (time.monotonic() - started)))
    assert [waiter.error for waiter in waiters] == [None] * 100
    assert [waiter.hint.delivery_id if waiter.hint else None for waiter in waiters] == [
        item.id for item in woken
    ]
    print(f"100 waiters woken in {time.monotonic() - started:.2f} s")


def test_refusals_reach_the_client_as_named_errors(server):
    owner = factories.community("localhost")
    key = secret()
    factories.enroll(owner, [pubkey(key)])
    with AgentClient(base_url(server, "127.0.0.1"), key) as agent:
        with pytest.raises(AgentApiError) as caught:
            agent.claim()
        assert (caught.value.status, caught.value.code) == (404, "unknown_community")
    with AgentClient(base_url(server, "localhost"), key) as agent:
        with pytest.raises(AgentApiError) as caught:
            agent.claim(lease_seconds=10**9)
        assert (caught.value.status, caught.value.code) == (400, "invalid_request")
    with AgentClient(base_url(server, "localhost"), secret()) as stranger:
        with pytest.raises(AgentApiError) as caught:
            stranger.claim()
        assert (caught.value.status, caught.value.code) == (401, "auth_unknown_agent")


def test_one_signed_request_sent_at_once_to_two_server_processes_is_served_once():
    """uvicorn with two worker processes: the same event from 8 connections at once."""
    owner = factories.community("localhost")
    key = secret()
    factories.committed(factories.Step(owner=owner, targets=[pubkey(key)]))
    with uvicorn_server(workers=2) as root:
        port = int(root.rsplit(":", 1)[1])
        url = f"http://localhost:{port}/agents/v1/claim"
        header = nip98.sign_request(key, url=url, method="POST")
        barrier = threading.Barrier(8)
        answers: list[tuple[int, str | None]] = []

        def send() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                barrier.wait(30)
                conn.request(
                    "POST",
                    "/agents/v1/claim",
                    headers={"Host": f"localhost:{port}", "Authorization": header},
                )
                response = conn.getresponse()
                body = response.read()
                answers.append(
                    (
                        response.status,
                        json.loads(body)["error"] if body and response.status == 401 else None,
                    )
                )
            finally:
                conn.close()

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert sorted(answers) == [(200, None)] + [(401, "auth_replay")] * 7


def test_a_wait_in_flight_when_the_listener_s_session_ends_is_answered_and_the_next_is_woken(
    server,
):
    """As after a failover: the server's listening session ends under a parked wait.
    The wait is answered empty once the listener is back (not at its timeout), and the
    agent's next wait is woken by the next commit."""
    owner = factories.community("localhost")
    key = secret()
    url = base_url(server, "localhost")
    factories.enroll(owner, [pubkey(key)])
    idle = IdleWakeTarget.objects.filter(community_id=owner.id, target_pubkey=pubkey(key))

    def parked() -> Waiting:
        waiting = Waiting(url, key, timeout=40)
        waiting.start()
        deadline = time.monotonic() + 15
        while not idle.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle.exists()
        time.sleep(0.2)
        return waiting

    in_flight = parked()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'workflow_delivery wake listener' "
            "AND datname = current_database()"
        )
        assert cursor.fetchone()[0] == 1
    in_flight.join(30)
    assert in_flight.error is None and in_flight.hint is None
    assert in_flight.elapsed < 15
    following = parked()
    committed_at = time.monotonic()
    (delivery,) = commit_and_wake(factories.Step(owner=owner, targets=[pubkey(key)]))
    following.join(40)
    assert following.error is None
    assert following.hint is not None and following.hint.delivery_id == delivery.id
    assert time.monotonic() - committed_at < 5
