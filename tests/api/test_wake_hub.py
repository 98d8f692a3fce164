"""The wake hub of one process (``api.wake.WakeHub``), in-process over the real server:
its memory of the idle registrations it made (forgotten when a notification consumes
one, and all of it when the listener's session is lost), the safety poll's one query
for every waiter, and every waiter sent to look again after a lost session."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from django.db import connection, connections
from django.test import override_settings

from tests.support import factories
from tests.support.agent_http import pubkey, secret
from tests.support.sessions import terminate
from workflow_delivery.api.wake import WakeHub
from workflow_delivery.services import commit_deliveries
from workflow_delivery.wakeups import WakeNotice

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def hub():
    hub = WakeHub()
    yield hub
    hub.stop()
    connections.close_all()


def settled(loop, futures, seconds: float = 15.0) -> None:
    loop.run_until_complete(asyncio.wait(futures, timeout=seconds))


def quietly_committed(owner, target: bytes) -> uuid.UUID:
    """A delivery committed by a process with wake-ups off: nobody is notified."""
    step = factories.Step(owner=owner, targets=[target])
    (delivery,) = step.new_deliveries()
    with override_settings(WORKFLOW_DELIVERY_NOTIFY=False):
        commit_deliveries(owner.id, step.created_at, [delivery])
    return delivery.id


def test_a_notification_consumes_the_registration_the_hub_remembers(hub, loop):
    community, mine, other = uuid.uuid4(), b"m" * 32, b"o" * 32
    hub.registering(community, mine)
    hub.registering(community, other)
    assert hub.registered(community, mine) and hub.registered(community, other)
    waiter = hub.register(community, mine, loop=loop)
    delivery = uuid.uuid4()
    assert hub.dispatch(WakeNotice(community, mine, delivery)) == 1
    settled(loop, {waiter.future})
    assert waiter.future.result() == delivery
    assert not hub.registered(community, mine)
    assert hub.registered(community, other)
    assert hub.waiting == 0


def test_a_registration_whose_statement_failed_is_not_remembered(hub):
    community, target = uuid.uuid4(), b"t" * 32
    hub.registering(community, target)
    hub.forget_registration(community, target)
    assert not hub.registered(community, target)


def test_the_safety_poll_wakes_only_the_waiters_with_a_claimable_delivery(hub, loop):
    owner = factories.community("sweep.example")
    found, idle = pubkey(secret()), pubkey(secret())
    factories.enroll(owner, [found, idle])
    hub.registering(owner.id, found)
    waiting_found = hub.register(owner.id, found, loop=loop)
    waiting_idle = hub.register(owner.id, idle, loop=loop)
    delivery_id = quietly_committed(owner, found)
    assert hub.sweep() == 1
    settled(loop, {waiting_found.future})
    assert waiting_found.future.result() == delivery_id
    assert not waiting_idle.future.done() and hub.waiting == 1
    # The poll consumed nothing: the registration the hub made still stands.
    assert hub.registered(owner.id, found)


def test_after_the_listener_s_session_is_lost_every_waiter_looks_again(hub, loop):
    community = uuid.uuid4()
    targets = [bytes([index]) * 32 for index in range(3)]
    assert hub.ensure_listening()
    for target in targets:
        hub.registering(community, target)
    waiters = [hub.register(community, target, loop=loop) for target in targets]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'workflow_delivery wake listener'"
        )
        (pid,) = [row[0] for row in cursor.fetchall()]
    terminate(pid)
    settled(loop, {waiter.future for waiter in waiters}, seconds=30)
    assert [waiter.future.result() for waiter in waiters] == [None, None, None]
    assert hub.waiting == 0
    assert not any(hub.registered(community, target) for target in targets)
    deadline = time.monotonic() + 15
    while not hub.ensure_listening(0.1) and time.monotonic() < deadline:
        pass
    assert hub.ensure_listening(0.1)


def test_with_wake_ups_off_one_poll_wakes_the_waiters_with_a_claimable_delivery(hub, loop):
    owner = factories.community("poll.example")
    found, idle = pubkey(secret()), pubkey(secret())
    factories.enroll(owner, [found, idle])
    waiting_found = hub.register(owner.id, found, loop=loop)
    waiting_idle = hub.register(owner.id, idle, loop=loop)
    delivery_id = quietly_committed(owner, found)
    with override_settings(WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS=0.2):
        hub.ensure_sweeping()
        settled(loop, {waiting_found.future})
    assert waiting_found.future.result() == delivery_id
    assert not waiting_idle.future.done() and hub.waiting == 1
