"""Wake-ups on real PostgreSQL: what a LISTEN session receives from producer commits
to targets registered as idle (``services.register_idle``)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection, transaction

from tests import factories
from workflow_delivery import services
from workflow_delivery.models import IdleWakeTarget
from workflow_delivery.protocol import NewDelivery
from workflow_delivery.wakeups import WakeListener, WakeNotice, format_wake, parse_wake

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
