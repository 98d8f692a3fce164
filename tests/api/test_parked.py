"""Waiting claims parked on the event loop (``api.asgi.Parked``) under uvicorn: woken by
a commit they answer with the lease and the middleware's headers; the waiter cap is
answered 503 ``too_many_waiters`` exactly above it; the safety poll (one query for
every waiter) finds a delivery whose notification was never sent; and after the
listener's session is lost every parked waiter looks again.

Two servers: one whose safety poll runs every second or so, one whose poll is too rare
to run during a test, so only the listener's loss can make its waiters look again.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from django.db import connection
from django.test import override_settings

from tests.support import factories
from tests.support.agent_http import pubkey, secret, uvicorn_server
from tests.support.sessions import terminate
from workflow_delivery.api import nip98
from workflow_delivery.client import AgentClient
from workflow_delivery.models import IdleWakeTarget
from workflow_delivery.services import commit_deliveries

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]

CAP = 2


@pytest.fixture(scope="module")
def sweeping(django_db_setup, django_db_blocker):
    env = {
        "WORKFLOW_DELIVERY_API_MAX_WAITERS": str(CAP),
        "WORKFLOW_DELIVERY_API_WAIT_SWEEP_SECONDS": "1.0",
    }
    with uvicorn_server(extra_env=env) as url:
        yield url


@pytest.fixture(scope="module")
def not_sweeping(django_db_setup, django_db_blocker):
    env = {"WORKFLOW_DELIVERY_API_WAIT_SWEEP_SECONDS": "3600"}
    with uvicorn_server(extra_env=env) as url:
        yield url


def base_url(server: str) -> str:
    return f"http://localhost:{server.rsplit(':', 1)[1]}/agents/"


class Claiming(threading.Thread):
    """One agent in a waiting claim on its own connection."""

    def __init__(self, url: str, key: bytes, wait: int) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.wait = url, key, wait
        self.claimed = self.error = None
        self.elapsed = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            with AgentClient(self.url, self.key, timeout=30) as client:
                self.claimed = client.claim(wait=self.wait, lease_seconds=30)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.elapsed = time.monotonic() - started


def agents(count: int):
    owner = factories.community("localhost")
    keys = [secret() for _ in range(count)]
    factories.enroll(owner, [pubkey(key) for key in keys])
    return owner, keys


def parked(owner, keys) -> None:
    """Until every key's claim is parked: its target registered as idle."""
    idle = IdleWakeTarget.objects.filter(
        community_id=owner.id, target_pubkey__in=[pubkey(key) for key in keys]
    )
    deadline = time.monotonic() + 15
    while idle.count() < len(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle.count() == len(keys)


def commit(owner, key, *, notify: bool = True):
    step = factories.Step(owner=owner, targets=[pubkey(key)])
    (delivery,) = step.new_deliveries()
    with override_settings(WORKFLOW_DELIVERY_NOTIFY=notify):
        commit_deliveries(owner.id, step.created_at, [delivery])
    return delivery


def test_a_parked_claim_is_woken_with_the_lease_and_the_middleware_s_headers(not_sweeping):
    owner, (key, other) = agents(2)
    claiming = Claiming(base_url(not_sweeping), key, wait=30)
    claiming.start()
    parked(owner, [key])
    delivery = commit(owner, key)
    claiming.join(30)
    assert claiming.error is None
    lease, record = claiming.claimed
    assert record.id == delivery.id and lease.generation == 1
    # Over a raw connection: the answer carries what the middleware set on the
    # placeholder (SecurityMiddleware's nosniff) and a length of its own.
    body = json.dumps({"wait": 20}).encode()
    port = int(not_sweeping.rsplit(":", 1)[1])
    url = f"http://localhost:{port}/agents/v1/claim"
    raw = http.client.HTTPConnection("localhost", port, timeout=30)
    waiter = threading.Thread(
        target=lambda: raw.request(
            "POST",
            "/agents/v1/claim",
            body=body,
            headers={
                "Content-Type": "application/json",
                "Authorization": nip98.sign_request(other, url=url, method="POST", body=body),
            },
        )
    )
    waiter.start()
    waiter.join(10)
    parked(owner, [other])
    second = commit(owner, other)
    answer = raw.getresponse()
    content = answer.read()
    raw.close()
    assert answer.status == 200
    assert json.loads(content)["lease"]["delivery_id"] == str(second.id)
    assert answer.getheader("Content-Length") == str(len(content))
    assert answer.getheader("X-Content-Type-Options") == "nosniff"


def test_a_parked_claim_with_nothing_sent_ends_empty(not_sweeping):
    _, (key,) = agents(1)
    claiming = Claiming(base_url(not_sweeping), key, wait=1)
    claiming.start()
    claiming.join(20)
    assert claiming.error is None and claiming.claimed is None
    assert claiming.elapsed >= 1


def test_the_waiter_cap_is_answered_503_exactly_above_it(sweeping):
    owner, keys = agents(CAP + 1)
    url = base_url(sweeping)
    held = [Claiming(url, key, wait=20) for key in keys[:CAP]]
    for claiming in held:
        claiming.start()
    parked(owner, keys[:CAP])
    with AgentClient(url, keys[CAP], timeout=30) as client:
        status, answer = client.request("POST", "v1/claim", {"wait": 20})
    assert status == 503 and answer["error"] == "too_many_waiters"
    # One of the cap's waiters claims and leaves: there is room for one more.
    commit(owner, keys[0])
    held[0].join(30)
    assert held[0].error is None and held[0].claimed is not None
    extra = Claiming(url, keys[CAP], wait=20)
    extra.start()
    parked(owner, [keys[CAP]])
    for key in (keys[1], keys[CAP]):
        commit(owner, key)
    for claiming in (held[1], extra):
        claiming.join(30)
        assert claiming.error is None and claiming.claimed is not None


def test_the_safety_poll_finds_a_delivery_whose_notification_was_never_sent(sweeping):
    owner, (key,) = agents(1)
    claiming = Claiming(base_url(sweeping), key, wait=30)
    claiming.start()
    parked(owner, [key])
    # Committed by a process with wake-ups off: no notification, the registration kept.
    delivery = commit(owner, key, notify=False)
    claiming.join(30)
    assert claiming.error is None
    assert claiming.claimed is not None and claiming.claimed[1].id == delivery.id
    assert claiming.elapsed < 20
    assert IdleWakeTarget.objects.filter(target_pubkey=pubkey(key)).exists()


def test_after_the_listener_s_session_is_lost_every_parked_claim_looks_again(not_sweeping):
    owner, keys = agents(3)
    url = base_url(not_sweeping)
    claims = [Claiming(url, key, wait=40) for key in keys]
    for claiming in claims:
        claiming.start()
    parked(owner, keys)
    # Nothing announces these: only a look of each waiter's own can find them.
    deliveries = [commit(owner, key, notify=False) for key in keys]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'workflow_delivery wake listener'"
        )
        listeners = [pid for (pid,) in cursor.fetchall()]
    # The other module's server listens too; it has no waiters to send looking.
    assert listeners
    for pid in listeners:
        terminate(pid)
    for claiming, delivery in zip(claims, deliveries, strict=True):
        claiming.join(45)
        assert claiming.error is None
        assert claiming.claimed is not None and claiming.claimed[1].id == delivery.id
        # Well before the end of its wait: the listener's loss sent it to look.
        assert claiming.elapsed < 35


def test_a_claim_waiting_again_on_the_registration_it_left_is_woken(not_sweeping):
    """An empty answer leaves the target registered as idle, and the process knows it
    made that registration: the next waiting claim does not make it again, and the
    producer's notification (which consumes it) still wakes that claim."""
    owner, (key,) = agents(1)
    url = base_url(not_sweeping)
    first = Claiming(url, key, wait=1)
    first.start()
    first.join(20)
    assert first.error is None and first.claimed is None
    idle = IdleWakeTarget.objects.filter(community_id=owner.id, target_pubkey=pubkey(key))
    assert idle.exists()
    again = Claiming(url, key, wait=30)
    again.start()
    time.sleep(1.0)
    delivery = commit(owner, key)
    again.join(35)
    assert again.error is None
    assert again.claimed is not None and again.claimed[1].id == delivery.id
    # Woken, not ended by its deadline (this server's safety poll never runs), and the
    # notification consumed the registration.
    assert again.elapsed < 20
    assert not idle.exists()
