"""Wake-ups on by default, through the idle registry, on real PostgreSQL.

A consumer (or a ``wait``) that found nothing registers its targets as idle; a
producer's commit notifies only those, once, and consumes the registration. These
tests run every setting at its default unless they name one, and watch the channel
from a session of their own (``WakeListener``) to see what producers send.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from tests import factories
from tests.test_consumer import Recorder, Running, consumer_for, eventually, started, status
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced
from workflow_delivery.models import IdleWakeTarget
from workflow_delivery.protocol import DeliveryStatus, NewDelivery
from workflow_delivery.wakeups import WakeListener

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]

QUIET_SECONDS = 0.3
# A poll this far away cannot explain a claim within a second.
LONG_POLL = 30


def registered(step: factories.Step) -> set[bytes]:
    rows = IdleWakeTarget.objects.filter(community_id=step.community.id)
    return {bytes(key) for key in rows.values_list("target_pubkey", flat=True)}


def idle_consumer(step: factories.Step, handler: Recorder, **options) -> Running:
    options.setdefault("poll_interval", LONG_POLL)
    return Running(consumer_for(step, handler, **options))


def wait_until_idle(step: factories.Step) -> None:
    """Until the consumer has registered its targets, made its last look and waits."""
    assert eventually(lambda: registered(step) == set(step.targets), 5)
    time.sleep(0.2)


def commit_step(step: factories.Step, step_id: str) -> list[NewDelivery]:
    deliveries = [NewDelivery(step.binding(target, step_id=step_id)) for target in step.targets]
    created = services.commit_deliveries(step.community.id, step.created_at, deliveries)
    assert created == [item.id for item in deliveries]
    return deliveries


def test_with_every_setting_at_its_default_a_consumer_claims_a_commit_in_under_a_second(db):
    step = factories.Step(targets=1)
    handler = Recorder()
    with idle_consumer(step, handler) as running:
        assert running.consumer.listen is True
        started(running.consumer)
        wait_until_idle(step)
        committed_at = time.monotonic()
        (delivery,) = factories.committed(step)
        assert eventually(lambda: delivery.id in handler.started, 5)
        assert handler.started[delivery.id] - committed_at < 1.0
        assert eventually(lambda: status(delivery.id) == DeliveryStatus.FINISHED)
        # Done, it found nothing again and registered again: the next commit wakes it.
        wait_until_idle(step)
        committed_at = time.monotonic()
        (second,) = commit_step(step, "second")
        assert eventually(lambda: second.id in handler.started, 5)
        assert handler.started[second.id] - committed_at < 1.0
    assert running.stats.finished == 2


def test_a_producer_whose_targets_have_no_idle_consumer_sends_nothing(db):
    step = factories.Step(targets=3)
    with WakeListener() as listener:
        # Nobody registered: neither path of the producer sends a notification.
        factories.committed(step)
        with services.delivery_identity(step.community.id, step.run.id, "step-2") as identity:
            identity.commit(
                step.created_at,
                [NewDelivery(step.binding(t, step_id="step-2")) for t in step.targets],
            )
        assert listener.wait(QUIET_SECONDS) == []


def test_a_busy_consumer_costs_one_notification_however_many_commits(db):
    step = factories.Step(targets=1)
    release = threading.Event()
    handler = Recorder(lambda record, lease, context: release.wait(10))
    with WakeListener() as listener, idle_consumer(step, handler, lease_seconds=30) as running:
        started(running.consumer)
        wait_until_idle(step)
        (first,) = factories.committed(step)
        assert len(listener.wait(2)) == 1
        assert eventually(lambda: first.id in handler.started, 5)
        # Busy with the first: ten more commits announce nothing.
        for n in range(10):
            commit_step(step, f"busy-{n}")
        assert listener.wait(QUIET_SECONDS) == []
        assert registered(step) == set()
        release.set()
        # It works through the backlog without a wake, claiming as it goes.
        assert eventually(lambda: len(handler.started) == 11, 10)
    assert running.stats.finished == 11


def test_a_rolled_back_commit_wakes_nobody_and_the_next_commit_still_wakes(db):
    step = factories.Step(targets=1)
    handler = Recorder()

    class Abandon(Exception):
        pass

    with WakeListener() as listener, idle_consumer(step, handler) as running:
        started(running.consumer)
        wait_until_idle(step)
        block = services.delivery_identity(step.community.id, step.run.id, step.step_id)
        with pytest.raises(Abandon), block as identity:
            identity.commit(step.created_at, step.new_deliveries())
            raise Abandon
        assert listener.wait(QUIET_SECONDS) == []
        assert handler.started == {}
        # The rollback restored the registration it had consumed.
        assert registered(step) == set(step.targets)
        committed_at = time.monotonic()
        (delivery,) = factories.committed(step)
        assert eventually(lambda: delivery.id in handler.started, 5)
        assert handler.started[delivery.id] - committed_at < 1.0
    assert running.stats.finished == 1


def test_a_skipped_duplicate_wakes_nobody_and_the_next_commit_still_wakes(db):
    step = factories.Step(targets=1)
    handler = Recorder()
    with WakeListener() as listener, idle_consumer(step, handler) as running:
        started(running.consumer)
        wait_until_idle(step)
        (first,) = factories.committed(step)
        assert eventually(lambda: status(first.id) == DeliveryStatus.FINISHED, 5)
        wait_until_idle(step)
        assert len(listener.wait(QUIET_SECONDS)) == 1
        # The same step again under fresh ids: nothing created, nothing sent.
        retry = step.new_deliveries()
        assert services.commit_deliveries(step.community.id, step.created_at, retry) == []
        assert listener.wait(QUIET_SECONDS) == []
        assert registered(step) == set(step.targets)
        assert list(handler.started) == [first.id]
        committed_at = time.monotonic()
        (second,) = commit_step(step, "second")
        assert eventually(lambda: second.id in handler.started, 5)
        assert handler.started[second.id] - committed_at < 1.0
    assert running.stats.finished == 2


def test_a_dropped_listener_misses_nothing(db):
    step = factories.Step(targets=1)
    handler = Recorder()
    with idle_consumer(step, handler) as running:
        started(running.consumer)
        wait_until_idle(step)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'workflow_delivery wake listener' "
                "AND datname = current_database()"
            )
        # Committed while the session is gone: its notification reaches nobody. The
        # consumer, listening again, polls at once rather than at its 30 s poll.
        committed_at = time.monotonic()
        (delivery,) = factories.committed(step)
        assert eventually(lambda: delivery.id in handler.started, 10)
        assert handler.started[delivery.id] - committed_at < 10
        assert eventually(lambda: status(delivery.id) == DeliveryStatus.FINISHED)
    assert running.stats.finished == 1


def test_a_commit_whose_insert_began_before_the_registration_is_found_by_the_poll(db):
    """The one wake an idle consumer can miss: the producer's insert ran before the
    consumer registered and its commit landed after the consumer's last look. No
    notification is sent and none is sent wrongly; the next poll claims it."""
    step = factories.Step(targets=1)
    handler = Recorder()
    with WakeListener() as listener, contextlib.ExitStack() as stack:
        with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
            (delivery,) = step.new_deliveries()
            assert identity.commit(step.created_at, [delivery]) == [delivery.id]
            # Started once the insert has run, stopped only after the commit below.
            running = stack.enter_context(idle_consumer(step, handler, poll_interval=1.0))
            started(running.consumer)
            wait_until_idle(step)
            assert handler.started == {}
        # The block has committed: its insert never saw the registration.
        committed_at = time.monotonic()
        assert listener.wait(QUIET_SECONDS) == []
        assert eventually(lambda: delivery.id in handler.started, 5)
        # Found by the poll (every second here), not by a wake-up.
        assert handler.started[delivery.id] - committed_at <= 1.5
        assert listener.wait(QUIET_SECONDS) == []


def test_registering_in_a_fenced_community_is_refused_and_stores_nothing(db):
    step = factories.Step(targets=1)
    factories.move_to(step.community.id, "quiescing")
    with pytest.raises(CommunityWriteFenced):
        services.register_idle(step.community.id, step.targets)
    assert registered(step) == set()


@pytest.mark.parametrize("name", ["NOTIFY", "NOTIFY_IN_TRANSACTION"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_a_setting_that_is_not_a_real_bool_fails_the_check(settings, name, value):
    setattr(settings, f"WORKFLOW_DELIVERY_{name}", value)
    check_id = {
        "NOTIFY": "workflow_delivery.E011",
        "NOTIFY_IN_TRANSACTION": "workflow_delivery.E012",
    }
    with pytest.raises(SystemCheckError, match=check_id[name]):
        call_command("check")
    if name == "NOTIFY":
        # Not truthy either: a consumer then does not listen.
        assert consumer_for(factories.Step(targets=1), Recorder()).listen is False


@pytest.mark.parametrize("value", [True, False])
def test_a_real_bool_passes_the_check(settings, value):
    settings.WORKFLOW_DELIVERY_NOTIFY = value
    settings.WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION = value
    call_command("check")
