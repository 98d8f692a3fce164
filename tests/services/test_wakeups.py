"""Wake-ups on real PostgreSQL, on by default, through the idle registry: a consumer (or
a ``wait``) that found nothing registers its targets as idle (``services.register_idle``);
a producer's commit notifies only those, once, and consumes the registration. The tests
watch the channel from a session of their own (``WakeListener``) to see what producers
send, and run every setting at its default unless they name one."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, transaction

from tests.support import factories
from tests.support.consumers import Recorder, Running, consumer_for, eventually, started, status
from workflow_delivery import services
from workflow_delivery.conf import WorkflowDeliveryConfigurationError
from workflow_delivery.exceptions import CommunityWriteFenced
from workflow_delivery.models import IdleWakeTarget, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus, NewDelivery
from workflow_delivery.store.wake import WakeNotice, format_wake, parse_wake
from workflow_delivery.wakeups import WakeListener

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]

# How long "nothing arrives" is watched for; a notification on this machine takes ~1 ms.
QUIET_SECONDS = 0.3


@pytest.fixture(params=["after commit", "in transaction"])
def listener(request, settings):
    """A listening session, with the producer sending either way."""
    settings.WORKFLOW_DELIVERY_NOTIFY = True
    settings.WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION = request.param == "in transaction"
    with WakeListener() as listening:
        yield listening


def idle(step: factories.Step, *targets: bytes) -> None:
    """Register ``targets`` (default: all of the step's) as a consumer that found
    nothing would, after its session listens."""
    services.register_idle(step.community.id, list(targets or step.targets))


def registered(step: factories.Step) -> set[bytes]:
    rows = IdleWakeTarget.objects.filter(community_id=step.community.id)
    return {bytes(key) for key in rows.values_list("target_pubkey", flat=True)}


def drain(listener: WakeListener, seconds: float = 2.0) -> list[WakeNotice]:
    """Every hint that arrives until a quiet gap (or ``seconds`` with none at all)."""
    hints = listener.wait(seconds)
    while hints and (more := listener.wait(QUIET_SECONDS)):
        hints += more
    return hints


def hints_for(step: factories.Step, deliveries: list[NewDelivery]) -> set[WakeNotice]:
    """One hint per target of ``deliveries``: each names that target's row."""
    return {WakeNotice(step.community.id, d.binding.target_pubkey, d.id) for d in deliveries}


@pytest.mark.django_db
def test_payload_round_trip_and_malformed_payloads():
    community, target, delivery = uuid.uuid4(), factories.key32(), uuid.uuid4()
    payload = format_wake(community, target, delivery)
    assert payload == f"{community}:{target.hex()}:{delivery}"
    assert parse_wake(payload) == WakeNotice(community, target, delivery)
    good = [str(community), target.hex(), str(delivery)]
    malformed = [
        None,
        b"bytes",
        42,
        "",
        ":".join(good[:2]),
        ":".join([*good, "extra"]),
        ":".join([str(community).upper(), *good[1:]]),
        ":".join([good[0], target.hex().upper(), good[2]]),
        ":".join([good[0], target.hex()[:-2], good[2]]),
        ":".join([good[0], "zz" + target.hex()[2:], good[2]]),
        ":".join([*good[:2], str(delivery).replace("-", "")]),
        ":".join([*good[:2], "{" + str(delivery)[1:-1] + "}"]),
    ]
    for payload in malformed:
        assert parse_wake(payload) is None, payload


def test_commit_deliveries_wakes_each_idle_target_once(listener):
    step = factories.Step(targets=3)
    idle(step)
    deliveries = factories.committed(step)
    hints = drain(listener)
    assert len(hints) == 3 and set(hints) == hints_for(step, deliveries)
    # Each registration is consumed: the next step to the same targets sends nothing
    # until a consumer registers again.
    assert registered(step) == set()
    later = [NewDelivery(step.binding(t, step_id="step-2")) for t in step.targets]
    assert len(services.commit_deliveries(step.community.id, step.created_at, later)) == 3
    assert listener.wait(QUIET_SECONDS) == []
    idle(step, step.targets[1])
    again = [NewDelivery(step.binding(t, step_id="step-3")) for t in step.targets]
    assert len(services.commit_deliveries(step.community.id, step.created_at, again)) == 3
    assert set(drain(listener)) == hints_for(step, again[1:2])


def test_only_idle_targets_are_woken(listener):
    step = factories.Step(targets=3)
    idle(step, step.targets[0])
    # The same target idle in another community is not this commit's to wake.
    elsewhere = factories.Step(targets=[step.targets[1]])
    idle(elsewhere)
    deliveries = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, deliveries[:1])
    assert registered(elsewhere) == {step.targets[1]}


def test_identity_block_wakes_on_commit_only(listener):
    step = factories.Step(targets=2)
    idle(step)
    deliveries = step.new_deliveries()
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
        assert set(identity.commit(step.created_at, deliveries)) == {d.id for d in deliveries}
        # Inserted but not committed: PostgreSQL holds the notification back.
        assert listener.wait(QUIET_SECONDS) == []
    assert set(drain(listener)) == hints_for(step, deliveries)


def test_a_commit_inside_the_callers_transaction_wakes_after_that_commits(listener):
    step = factories.Step(targets=1)
    idle(step)
    with transaction.atomic():
        deliveries = factories.committed(step)
        assert listener.wait(QUIET_SECONDS) == []
    assert set(drain(listener)) == hints_for(step, deliveries)


def test_a_commit_in_a_rolled_back_savepoint_wakes_nobody(listener):
    step = factories.Step(targets=1)
    idle(step)
    with transaction.atomic():
        try:
            with transaction.atomic():
                factories.committed(step)
                raise RuntimeError("undo the savepoint")
        except RuntimeError:
            pass
    assert listener.wait(QUIET_SECONDS) == []
    # The registration came back with the rollback: the real commit still wakes.
    assert registered(step) == set(step.targets)
    deliveries = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, deliveries)


def test_rolled_back_commit_wakes_nobody(listener):
    step = factories.Step(targets=2)

    class Abandon(Exception):
        pass

    idle(step)
    identity_block = services.delivery_identity(step.community.id, step.run.id, step.step_id)
    with pytest.raises(Abandon), identity_block as identity:
        identity.commit(step.created_at, step.new_deliveries())
        raise Abandon
    assert listener.wait(QUIET_SECONDS) == []
    assert registered(step) == set(step.targets)
    deliveries = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, deliveries)


def test_skipped_duplicates_wake_nobody(listener):
    step = factories.Step(targets=2)
    idle(step)
    first = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, first)
    # A retry of the same step with fresh ids creates nothing and sends nothing,
    # though its targets are idle again, and leaves their registrations in place.
    idle(step)
    retry = step.new_deliveries()
    assert services.commit_deliveries(step.community.id, step.created_at, retry) == []
    assert listener.wait(QUIET_SECONDS) == []
    assert registered(step) == set(step.targets)
    # One new target next to an existing one: only the created row is announced.
    newcomer = factories.key32()
    factories.enroll(step.community, [newcomer])
    idle(step, newcomer)
    mixed = [
        NewDelivery(uuid.uuid4(), step.binding(step.targets[0])),
        NewDelivery(uuid.uuid4(), step.binding(newcomer)),
    ]
    created = services.commit_deliveries(step.community.id, step.created_at, mixed)
    assert created == [mixed[1].id]
    assert set(drain(listener)) == hints_for(step, [mixed[1]])
    assert registered(step) == set(step.targets)


def test_setting_off_sends_nothing(listener, settings):
    settings.WORKFLOW_DELIVERY_NOTIFY = False
    step = factories.Step(targets=2)
    idle(step)
    created = factories.committed(step)
    with services.delivery_identity(step.community.id, step.run.id, "step-2") as identity:
        other = [NewDelivery(uuid.uuid4(), step.binding(t, step_id="step-2")) for t in step.targets]
        assert len(identity.commit(step.created_at, other)) == 2
    assert len(created) == 2
    assert listener.wait(QUIET_SECONDS) == []
    assert registered(step) == set(step.targets)


def test_by_default_a_producer_wakes_idle_targets(listener, settings):
    # The app's own default: no WORKFLOW_DELIVERY_NOTIFY in the settings at all.
    del settings.WORKFLOW_DELIVERY_NOTIFY
    step = factories.Step(targets=2)
    idle(step)
    deliveries = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, deliveries)


def test_the_benchmarks_switch_reaches_a_producer_that_already_read_the_setting(listener):
    """bench/run.py notify turns wake-ups on and off between steps of one process
    (``bench.common.use_setting``): the app, having read the setting once, must follow."""
    from bench import common

    first = factories.Step(targets=1)
    idle(first)
    created = factories.committed(first)
    assert set(drain(listener)) == hints_for(first, created)
    common.use_setting("WORKFLOW_DELIVERY_NOTIFY", False)
    quiet = factories.Step(targets=1)
    idle(quiet)
    assert len(factories.committed(quiet)) == 1
    assert listener.wait(QUIET_SECONDS) == []
    common.use_setting("WORKFLOW_DELIVERY_NOTIFY", True)
    again = factories.Step(targets=1)
    idle(again)
    created = factories.committed(again)
    assert set(drain(listener)) == hints_for(again, created)


def test_listener_reconnects_after_its_session_is_killed(listener):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'workflow_delivery wake listener' AND datname = %s",
            [connection.settings_dict["NAME"]],
        )
    # The loss is noticed, then the next wait reopens the session; neither reports hints.
    assert listener.wait(QUIET_SECONDS) == []
    for _ in range(20):
        if listener.connected:
            break
        assert listener.wait(QUIET_SECONDS) == []
    assert listener.connected and listener.reconnects == 1
    step = factories.Step(targets=1)
    idle(step)
    deliveries = factories.committed(step)
    assert set(drain(listener)) == hints_for(step, deliveries)


# A poll this far away cannot explain a claim within a second.
LONG_POLL = 30


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


@pytest.mark.parametrize("name", ["NOTIFY", "NOTIFY_IN_TRANSACTION"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_a_setting_that_is_not_a_real_bool_is_refused_where_it_is_read(settings, name, value):
    """A script's consumer or producer runs no system check: reading the setting
    refuses it, naming it, and nothing is stored."""
    setattr(settings, f"WORKFLOW_DELIVERY_{name}", value)
    step = factories.Step(targets=1)
    message = f"WORKFLOW_DELIVERY_{name} must be True or False, got {value!r}"
    if name == "NOTIFY":
        with pytest.raises(WorkflowDeliveryConfigurationError, match=re.escape(message)):
            consumer_for(step, Recorder())
    with pytest.raises(WorkflowDeliveryConfigurationError, match=re.escape(message)):
        services.send_message(
            step.community.id, targets=step.targets, content="hello", idempotency_key="flag"
        )
    assert not WorkflowAgentDelivery.objects.exists()


@pytest.mark.parametrize("value", [True, False])
def test_a_real_bool_passes_the_check(settings, value):
    settings.WORKFLOW_DELIVERY_NOTIFY = value
    settings.WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION = value
    call_command("check")


def test_a_consumer_that_stops_cleanly_takes_back_its_idle_registrations():
    step = factories.Step(targets=2)
    other = factories.Step(targets=1, owner=step.community)
    services.register_idle(step.community.id, other.targets)
    with Running(consumer_for(step, Recorder())) as running:
        started(running.consumer)
        assert eventually(lambda: registered(step) >= set(step.targets), 5)
    # Its own targets only: another consumer's registration stays.
    assert registered(step) == set(other.targets)
