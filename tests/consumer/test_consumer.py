"""The consumer on real PostgreSQL: wake-ups, polling, heartbeats, loss, stopping."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from tests.support import factories
from tests.support.consumer_handlers import CREATE_EFFECTS, EFFECTS, write_effect
from tests.support.consumers import Recorder, Running, consumer_for, eventually, started, status
from tests.support.sessions import listening_sessions
from workflow_delivery import services
from workflow_delivery.consumer import Consumer
from workflow_delivery.exceptions import LeaseNotLive, ProtocolError
from workflow_delivery.models import IdleWakeTarget, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def effects() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(CREATE_EFFECTS)
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {EFFECTS}")


def effect_count(delivery_id) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {EFFECTS} WHERE delivery_id = %s", [delivery_id])
        return cursor.fetchone()[0]


@pytest.mark.psycopg3  # the wake-up listener needs psycopg 3; on psycopg2 nothing wakes
def test_a_wake_up_claims_at_once_despite_a_long_poll(db):
    step = factories.Step(targets=1)
    handler = Recorder()
    listening_before = listening_sessions()
    with Running(consumer_for(step, handler, poll_interval=30)) as running:
        assert running.consumer.listening.wait(5)
        assert listening_sessions() == listening_before + 1
        time.sleep(0.3)  # the worker's first poll found nothing; it now waits 30 s
        committed_at = time.monotonic()
        (delivery,) = factories.committed(step)
        assert eventually(lambda: delivery.id in handler.started, 5)
        assert handler.started[delivery.id] - committed_at < 1.0
        assert eventually(lambda: status(delivery.id) == DeliveryStatus.FINISHED)
    assert running.stats.finished == 1


def test_with_notifications_off_a_poll_still_claims(db, settings):
    # Nothing wakes the consumer: the producer sends nothing, and on psycopg2 the
    # consumer does not even listen. Only its polls can find these deliveries.
    settings.WORKFLOW_DELIVERY_NOTIFY = False
    step = factories.Step(targets=2)
    handler = Recorder()
    with Running(consumer_for(step, handler, poll_interval=0.3)) as running:
        started(running.consumer)
        time.sleep(0.4)
        deliveries = factories.committed(step)
        assert eventually(lambda: len(handler.started) == 2, 5)
        assert eventually(lambda: all(status(d.id) == DeliveryStatus.FINISHED for d in deliveries))
    assert running.stats.finished == 2


def test_a_consumer_told_not_to_listen_polls_and_registers_nothing(db):
    # Wake-ups are on (the default), but this consumer does not listen: it must not
    # register as idle either, or producers would notify a session nobody holds.
    step = factories.Step(targets=1)
    handler = Recorder()
    consumer = consumer_for(step, handler, poll_interval=0.3, listen=False)
    assert consumer_for(step, handler).listen is True
    listening_before = listening_sessions()
    with Running(consumer) as running:
        started(running.consumer)
        time.sleep(0.4)
        assert not IdleWakeTarget.objects.filter(community_id=step.community.id).exists()
        (delivery,) = factories.committed(step)
        assert eventually(lambda: status(delivery.id) == DeliveryStatus.FINISHED, 5)
        assert listening_sessions() == listening_before
        assert not running.consumer.listening.is_set()
    assert running.stats.finished == 1
    assert not IdleWakeTarget.objects.filter(community_id=step.community.id).exists()


def test_heartbeats_keep_a_handler_three_times_the_lease_alive(db):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def slow(record, lease, context) -> None:
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            # The reaper runs all along: a heartbeat that missed would lose the row.
            services.reap_expired_deliveries()
            time.sleep(0.2)
        handler.seen["lost"] = context.lost.is_set()

    handler = Recorder(slow)
    with Running(consumer_for(step, handler, lease_seconds=2, max_deliveries=1)) as running:
        stats = running.join(20)
    assert handler.seen == {"lost": False}
    assert stats.finished == 1 and stats.lost == 0
    assert stats.renewed >= 6
    assert status(delivery.id) == DeliveryStatus.FINISHED


def test_an_operator_release_is_seen_and_its_writes_do_not_commit(db, effects):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def released_under_it(record, lease, context) -> None:
        handler.seen["lost_in_time"] = context.lost.wait(5)
        try:
            write_effect(record, lease, context)
        except LeaseNotLive:
            handler.seen["holding"] = "refused"

    handler = Recorder(released_under_it)
    with Running(consumer_for(step, handler, lease_seconds=3, max_deliveries=1)) as running:
        assert handler.entered.wait(5)
        assert services.release_deliveries(step.community.id, [delivery.id]) == [delivery.id]
        stats = running.join(20)
    assert handler.seen == {"lost_in_time": True, "holding": "refused"}
    assert effect_count(delivery.id) == 0
    assert stats.lost == 1 and stats.finished == 0
    assert status(delivery.id) == DeliveryStatus.PENDING


def test_effects_through_holding_settle_and_a_failure_is_retried(db, effects, settings):
    good = factories.Step(targets=2)
    finished = factories.committed(good)
    with Running(consumer_for(good, write_effect, concurrency=2, max_deliveries=2)) as running:
        stats = running.join(20)
    assert stats.finished == 2 and stats.claimed == 2
    assert [effect_count(d.id) for d in finished] == [1, 1]

    bad = factories.Step(targets=1)
    (failing,) = factories.committed(bad)

    def refuse(record, lease, context) -> None:
        raise RuntimeError("no")

    settings.WORKFLOW_DELIVERY_MAX_ATTEMPTS = 2
    settings.WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS = 0.05
    with Running(consumer_for(bad, refuse, max_deliveries=2, poll_interval=0.05)) as running:
        stats = running.join(20)
    # The first failure is retried; the second uses the last attempt and fails it.
    assert (stats.claimed, stats.retried, stats.failed) == (2, 1, 1)
    assert status(failing.id) == DeliveryStatus.FAILED


def test_a_handlers_statement_timeout_is_a_failed_attempt_not_a_lost_connection(db):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def slow_statement(record, lease, context) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '20ms'")
            cursor.execute("SELECT pg_sleep(2)")

    with Running(consumer_for(step, slow_statement, max_deliveries=1, poll_interval=0.05)) as run:
        stats = run.join(20)
    assert (stats.retried, stats.released, stats.connection_errors) == (1, 0, 0)
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert row.status == DeliveryStatus.PENDING and row.attempts == 1
    assert row.last_error_type == "django.db.utils.OperationalError"
    assert "statement timeout" in row.last_error_message


def test_a_handler_whose_session_is_killed_gives_its_lease_back_with_no_error(db):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def lose_session(record, lease, context) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    with Running(consumer_for(step, lose_session, max_deliveries=1, poll_interval=0.05)) as run:
        stats = run.join(20)
    assert (stats.retried, stats.released) == (0, 1)
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert row.status == DeliveryStatus.PENDING and row.last_error_type is None


def test_a_handler_whose_session_the_server_ends_when_idle_gives_its_lease_back(db):
    """``idle_session_timeout`` ends the session between two of the handler's
    statements (57P05): a lost connection, not the handler failing."""
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def idle_too_long(record, lease, context) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET idle_session_timeout = '100ms'")
        time.sleep(0.5)
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    with Running(consumer_for(step, idle_too_long, max_deliveries=1, poll_interval=0.05)) as run:
        stats = run.join(20)
    assert (stats.retried, stats.released) == (0, 1)
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert row.status == DeliveryStatus.PENDING and row.last_error_type is None


def test_a_stop_lets_a_short_handler_finish_and_releases_a_long_one(db):
    step = factories.Step(targets=2)
    quick, slow = factories.committed(step)
    go = threading.Event()

    def body(record, lease, context) -> None:
        assert context.stopping.wait(10)
        if record.id == slow.id:
            handler.seen["slow_lost"] = context.lost.wait(10)
        go.set()

    handler = Recorder(body)
    consumer = consumer_for(step, handler, concurrency=2, grace_seconds=0.5)
    with Running(consumer) as running:
        assert eventually(lambda: len(handler.started) == 2, 5)
        started = time.monotonic()
        consumer.stop()
        stats = running.join(10)
        assert time.monotonic() - started < 5
    assert stats.finished == 1 and stats.released == 1
    assert status(quick.id) == DeliveryStatus.FINISHED
    assert status(slow.id) == DeliveryStatus.PENDING
    assert eventually(lambda: handler.seen.get("slow_lost") is True, 5)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lease_seconds", 0),
        ("concurrency", 0),
        ("poll_interval", 0),
        ("max_deliveries", -1),
        ("grace_seconds", -1),
        ("listen", "yes"),
    ],
)
def test_bad_options_name_the_field(db, option, value):
    step = factories.Step(targets=1)
    field = "lease_seconds" if option == "lease_seconds" else option
    with pytest.raises(ProtocolError) as error:
        consumer_for(step, write_effect, **{option: value})
    assert error.value.field == field


def test_bad_targets_and_handler_are_refused(db):
    step = factories.Step(targets=1)
    with pytest.raises(ProtocolError, match="targets"):
        Consumer(step.community.id, [], write_effect)
    with pytest.raises(ProtocolError, match="targets"):
        Consumer(step.community.id, [b"short"], write_effect)
    with pytest.raises(ProtocolError, match="handler"):
        Consumer(step.community.id, step.targets, 42)  # type: ignore[arg-type]


def test_it_reconnects_after_its_sessions_are_killed(db):
    step = factories.Step(targets=1)
    handler = Recorder()
    with Running(consumer_for(step, handler, poll_interval=0.3)) as running:
        sessions = started(running.consumer)
        time.sleep(0.3)
        with connection.cursor() as cursor:
            # Every session of this test database but our own: the consumer's worker,
            # and its listener where there is one (the heartbeat connects on a beat).
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchone()[0] >= sessions
        deliveries = factories.committed(step)
        assert eventually(lambda: len(handler.started) == 1, 10)
        assert eventually(lambda: status(deliveries[0].id) == DeliveryStatus.FINISHED, 5)
    assert running.stats.finished == 1
    assert running.stats.connection_errors >= 1


def test_a_heartbeat_behind_the_handlers_own_block_is_busy_not_lost(db, effects):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)

    def long_block(record, lease, context) -> None:
        with context.holding() as held:
            # The block holds the row across at least one beat (every 2/3 s).
            time.sleep(1.2)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {EFFECTS} (delivery_id, generation) VALUES (%s, %s)",
                    [lease.delivery_id, lease.generation],
                )
            held.finish("finished")

    with Running(consumer_for(step, long_block, lease_seconds=2, max_deliveries=1)) as running:
        stats = running.join(20)
    assert stats.renew_busy >= 1, stats
    assert stats.finished == 1 and stats.lost == 0, stats
    assert effect_count(delivery.id) == 1
    assert status(delivery.id) == DeliveryStatus.FINISHED


# -- settling and claiming the next in one statement ----------------------------------


def row_xmin(delivery_id) -> int:
    """The transaction that last wrote the delivery's row."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmin::text::bigint FROM workflow_agent_deliveries WHERE id = %s", [delivery_id]
        )
        return cursor.fetchone()[0]


def backlog(step: factories.Step, count: int) -> list:
    ids = []
    for n in range(count):
        ids += [delivery.id for delivery in factories.committed(step)]
        step.step_id = f"step-{n + 2}"
    return ids


def test_a_busy_worker_settles_each_delivery_and_claims_the_next_in_one_transaction(db):
    step = factories.Step(targets=1)
    ids = backlog(step, 4)
    handled: list = []
    same_transaction: list[bool] = []

    def body(record, lease, context) -> None:
        if handled:
            # The previous delivery settled in the transaction that claimed this one.
            same_transaction.append(row_xmin(handled[-1]) == row_xmin(record.id))
        handled.append(record.id)

    consumer = consumer_for(step, Recorder(body), max_deliveries=4, listen=False)
    with Running(consumer) as running:
        running.join()
    assert handled == ids
    assert same_transaction == [True, True, True]
    assert {status(delivery_id) for delivery_id in ids} == {DeliveryStatus.FINISHED}
    assert running.stats.claimed == running.stats.finished == 4


def test_max_deliveries_bounds_the_claims_made_with_a_settle(db):
    step = factories.Step(targets=1)
    first, second, third = backlog(step, 3)
    consumer = consumer_for(step, Recorder(), max_deliveries=2, listen=False)
    with Running(consumer) as running:
        running.join()
    assert [status(first), status(second)] == [DeliveryStatus.FINISHED] * 2
    left = WorkflowAgentDelivery.objects.get(pk=third)
    assert (left.status, left.lease_generation) == ("pending", 0)


def test_a_settle_claims_the_next_target_in_turn(db):
    step = factories.Step(targets=2)
    backlog(step, 3)
    targets: list[bytes] = []
    handler = Recorder(lambda record, lease, context: targets.append(record.binding.target_pubkey))
    consumer = consumer_for(step, handler, max_deliveries=6, listen=False)
    with Running(consumer) as running:
        running.join()
    assert targets == [step.targets[0], step.targets[1]] * 3
