"""The long poll, ``GET v1/wait``, in-process: the bounds of its timeout, its answer at
once for a delivery already pending and its empty answer at the timeout, the limit on
waiters, and whether it polls for new deliveries or registers its caller for wake-ups.
It starts this process's wake listener, which conftest.py's ``stop_wake_listener``
closes at the end of the module."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

from tests.api.helpers import answer
from tests.support import factories
from tests.support.sessions import listening_sessions
from workflow_delivery.admin.target import IDLE_LIVE, read_target_state
from workflow_delivery.api.wake import hub
from workflow_delivery.models import IdleWakeTarget, WorkflowAgentDelivery

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


def test_wait_timeout_out_of_range_is_a_400(client, agent):
    answer(agent.call(client, "GET", "v1/wait", query="timeout=61"), 400, "invalid_request")
    answer(agent.call(client, "GET", "v1/wait", query="timeout=soon"), 400, "invalid_request")


def test_wait_answers_at_once_for_a_delivery_already_pending(client, agent):
    started = time.monotonic()
    hint = answer(agent.call(client, "GET", "v1/wait", query="timeout=30"), 200)
    assert hint == {"delivery_id": str(agent.delivery.id), "target": agent.pubkey.hex()}
    assert time.monotonic() - started < 10


def test_wait_beyond_the_waiter_limit_is_told_to_poll(client, agent, settings):
    settings.WORKFLOW_DELIVERY_API_MAX_WAITERS = 0
    answer(agent.call(client, "GET", "v1/wait", query="timeout=5"), 503, "too_many_waiters")


def test_wait_without_a_pending_delivery_ends_empty(client, agent):
    answer(agent.call(client, "POST", "v1/claim"), 200)
    assert answer(agent.call(client, "GET", "v1/wait", query="timeout=1"), 204) is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("notify", [False, True], ids=["wake-ups off", "wake-ups on"])
def test_a_wait_polls_only_when_producers_send_no_wake_ups(client, agent, settings, notify):
    """Wake-ups off: a delivery committed while the agent waits is found by the
    wait's own poll, and the wait registers nothing. On (the default), the wait
    registers its caller as idle and relies on wake-ups: a delivery committed without
    one (sent by a process that has them off) is not seen before the timeout."""
    settings.WORKFLOW_DELIVERY_NOTIFY = notify
    settings.WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS = 0.2
    answer(agent.call(client, "POST", "v1/claim"), 200)
    later = factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id="later")

    def commit_quietly() -> None:
        try:
            time.sleep(0.5)
            with override_settings(WORKFLOW_DELIVERY_NOTIFY=False):
                factories.committed(later)
        finally:
            connections.close_all()

    hub.stop()
    deadline = time.monotonic() + 5
    while listening_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)  # the stopped listener's backend is on its way out
    committer = threading.Thread(target=commit_quietly)
    committer.start()
    started = time.monotonic()
    response = agent.call(client, "GET", "v1/wait", query="timeout=3")
    elapsed = time.monotonic() - started
    committer.join(10)
    # The process listens, and registers its waiter, only when there are wake-ups
    # to hear; the quiet producer left the registration in place.
    assert listening_sessions() == int(notify)
    idle = IdleWakeTarget.objects.filter(target_pubkey=agent.pubkey)
    assert list(idle.values_list("community_id", flat=True)) == (
        [agent.step.community.id] if notify else []
    )
    if notify:
        assert answer(response, 204) is None and elapsed >= 3
        # The registration names the hub's listening session, which gets the wake-up
        # and outlives the request (whose connection is released while it waits).
        (row,) = idle
        session = hub.session
        assert (row.pid, row.backend_start) == (session.pid, session.backend_start)
        state = read_target_state(agent.step.community.id, agent.pubkey)
        assert state.idle_session == IDLE_LIVE
    else:
        (delivery,) = WorkflowAgentDelivery.objects.filter(step_id="later")
        hint = answer(response, 200)
        assert hint == {"delivery_id": str(delivery.id), "target": agent.pubkey.hex()}
        assert elapsed < 2
