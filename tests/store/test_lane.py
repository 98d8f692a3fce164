"""The lane: the app's autocommit statements sent below psycopg's cursor, prepared once
each, keep every promise of the cursor path: the same rows, the same errors, Django's
connection rules, statements prepared again when something drops them, Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid

import pytest
from django.db import OperationalError, connection, transaction
from django.test import override_settings

from tests.support import factories
from tests.support.sessions import backend_pid, terminate
from workflow_delivery import services
from workflow_delivery.exceptions import (
    CommunityWriteFenced,
    DeliveryConflict,
    ReferenceMissing,
)
from workflow_delivery.models import DeliveryTransition
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    LeaseLost,
    NewDelivery,
    Outcome,
    Renewed,
    Settled,
)
from workflow_delivery.store import lane
from workflow_delivery.store.statement import Statement

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]


def lane_statements() -> list[str]:
    """The lane's prepared statements on the test connection, by name."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name FROM pg_prepared_statements "
            "WHERE name LIKE 'workflow\\_delivery\\_%' ORDER BY name"
        )
        return [name for (name,) in cursor.fetchall()]


def kinds(delivery_id: uuid.UUID) -> list[str]:
    """The kinds of a delivery's stored timeline entries, oldest first."""
    entries = DeliveryTransition.objects.filter(delivery_id=delivery_id).order_by("id")
    return list(entries.values_list("kind", flat=True))


def cycle(step: factories.Step, target: bytes | None = None) -> Settled:
    lease, _ = services.claim_delivery(step.community.id, target or step.targets[0])
    return services.finish_delivery(lease, Outcome.FINISHED)


def released_cycle(step: factories.Step, target: bytes) -> Settled:
    """A cycle whose first lease is given back: a departure, which the timeline stores."""
    lease, _ = services.claim_delivery(step.community.id, target)
    services.release_lease(lease)
    return cycle(step, target)


def test_placeholders_are_numbered_for_libpq_and_percent_signs_kept():
    statement = Statement("SELECT %(a)s, %(b)s::text || '%%' WHERE x LIKE %(a)s || 'a%%'")
    assert statement.numbered == b"SELECT $1, $2::text || '%' WHERE x LIKE $3 || 'a%'"
    assert statement.sql == "SELECT %s, %s::text || '%%' WHERE x LIKE %s || 'a%%'"
    assert statement.args({"a": 1, "b": 2}) == [1, 2, 1]


def test_a_positional_placeholder_is_refused():
    with pytest.raises(ValueError):
        Statement("SELECT %s")


def test_autocommit_statements_are_prepared_once_and_reused():
    step = factories.Step(targets=4)
    factories.committed(step)
    assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    prepared = lane_statements()
    # The claim and the finish, at least; the producer's insert too.
    assert len(prepared) >= 3
    for target in step.targets[1:]:
        assert cycle(step, target) == Settled(Outcome.FINISHED)
    assert lane_statements() == prepared


def test_every_operation_answers_through_the_lane_as_through_the_cursor():
    answers = {}
    for prepared in (True, False):
        step = factories.Step(targets=3)
        with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared):
            created = services.commit_deliveries(
                step.community.id, step.created_at, step.new_deliveries()
            )
            retry = services.commit_deliveries(
                step.community.id, step.created_at, step.new_deliveries()
            )
            lease, record = services.claim_delivery(step.community.id, step.targets[0])
            renewed = services.renew_delivery(lease, lease_seconds=120)
            settled = services.finish_delivery(lease, Outcome.FAILED)
            again = services.finish_delivery(lease, Outcome.FINISHED)
            batch = services.claim_deliveries(step.community.id, step.targets[1], limit=5)
            finished = services.finish_deliveries([(batch[0][0], Outcome.FINISHED)])
            lost = services.renew_delivery(batch[0][0])
            released = services.release_lease(
                services.claim_delivery(step.community.id, step.targets[2])[0]
            )
        stored = services.get_delivery(step.community.id, record.id)
        assert record.binding == stored.binding
        assert (record.status, record.lease_generation) == (DeliveryStatus.CLAIMED, 1)
        assert isinstance(renewed, Renewed) and renewed.lease_until > record.lease_until
        answers[prepared] = (
            len(created),
            retry,
            settled,
            again,
            len(batch),
            finished,
            lost,
            released,
        )
    assert (
        answers[True]
        == answers[False]
        == (
            3,
            [],
            Settled(Outcome.FAILED),
            AlreadyTerminal(DeliveryStatus.FAILED),
            1,
            [Settled(Outcome.FINISHED)],
            LeaseLost(),
            True,
        )
    )


def test_statements_dropped_under_the_lane_are_prepared_again():
    step = factories.Step(targets=2)
    factories.committed(step)
    assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    assert lane_statements()
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert lane_statements() == []
    assert cycle(step, step.targets[1]) == Settled(Outcome.FINISHED)
    assert lane_statements()


def test_psycopgs_deallocate_after_a_rollback_does_not_break_the_lane():
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    # holding() prepares through psycopg's cursor; its rollback makes psycopg send
    # DEALLOCATE ALL, which drops the lane's statements as well.
    with pytest.raises(RuntimeError), services.holding(lease):
        raise RuntimeError("the handler failed")
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert lane_statements() == []
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
    assert cycle(step, step.targets[1]) == Settled(Outcome.FINISHED)


def test_a_refused_statement_is_the_domain_error_and_the_lane_serves_on():
    healthy, frozen, other = factories.Step(), factories.Step(), factories.Step()
    taken = factories.committed(healthy)[0].id
    factories.committed(frozen)
    services.transition_community(frozen.community.id, "quiescing")
    with pytest.raises(CommunityWriteFenced) as caught:
        services.claim_delivery(frozen.community.id, frozen.targets[0])
    assert caught.value.community_id == frozen.community.id
    with pytest.raises(DeliveryConflict):
        services.commit_deliveries(
            other.community.id, other.created_at, [NewDelivery(taken, other.binding())]
        )
    missing_run = NewDelivery(uuid.uuid4(), other.binding(run_id=uuid.uuid4()))
    with pytest.raises(ReferenceMissing):
        services.commit_deliveries(other.community.id, other.created_at, [missing_run])
    assert cycle(healthy) == Settled(Outcome.FINISHED)


def test_a_lost_connection_is_djangos_operational_error_and_the_next_call_reconnects():
    step = factories.Step(targets=2)
    factories.committed(step)
    assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    terminate(backend_pid())
    with pytest.raises(OperationalError):
        services.claim_delivery(step.community.id, step.targets[1])
    assert connection.errors_occurred
    # What a worker loop does between passes (close_old_connections).
    connection.close_if_unusable_or_obsolete()
    assert cycle(step, step.targets[1]) == Settled(Outcome.FINISHED)


def test_the_timeline_setting_reaches_the_session_through_the_lane():
    step = factories.Step(targets=2)
    quiet, recorded = (item.id for item in factories.committed(step))
    with override_settings(WORKFLOW_DELIVERY_TIMELINE=False):
        assert released_cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    assert released_cycle(step, step.targets[1]) == Settled(Outcome.FINISHED)

    assert kinds(quiet) == []
    assert kinds(recorded) == ["claimed", "released"]


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt for the test, whatever the process inherited: a
    job started in the background (``scripts/test &``) inherits SIGINT ignored, and
    Python then installs no handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_statement_waiting_on_a_lock_is_cancelled_by_ctrl_c(ctrl_c_raises):
    step = factories.Step()
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    other = connection.get_new_connection(connection.get_connection_params())
    timer = threading.Timer(0.5, os.kill, [os.getpid(), signal.SIGINT])
    try:
        other.autocommit = False
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE",
                [lease.delivery_id],
            )
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            services.finish_delivery(lease, Outcome.FINISHED)
        other.rollback()
    finally:
        timer.cancel()
        other.close()
    # The query was cancelled, not left running: the connection serves the retry.
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def interrupt_after_the_send(frame, event, arg):
    """A trace function: Ctrl-C inside the lane's generator, once the statement has
    been sent and before its answer is read (where a SIGINT lands when the
    interpreter runs that frame, as under load)."""
    if frame.f_code is not lane._sent.__code__:
        return None
    lines = []

    def local(frame, event, arg):
        if event == "line":
            lines.append(frame.f_lineno)
            if len(lines) == 2:  # the send() line ran; now the read
                sys.settrace(None)
                raise KeyboardInterrupt
        return local

    return local


def test_ctrl_c_between_send_and_read_leaves_the_session_idle():
    step = factories.Step()
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    assert isinstance(services.renew_delivery(lease), Renewed)  # prepared
    sys.settrace(interrupt_after_the_send)
    try:
        with pytest.raises(KeyboardInterrupt):
            services.renew_delivery(lease)
    finally:
        sys.settrace(None)
    assert connection.connection.pgconn.transaction_status == lane.IDLE
    # The lane and Django's own cursor both get the session back.
    assert isinstance(services.renew_delivery(lease), Renewed)
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def test_inside_a_transaction_statements_take_the_cursor_path():
    step = factories.Step(targets=2)
    factories.committed(step)
    before = lane_statements()
    with transaction.atomic():
        assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    assert lane_statements() == before


@pytest.fixture
def pooled():
    """Django's psycopg pool on the default alias, one session in it, so every wrapper
    that connects gets the same session: what a pool does to a site's requests."""
    settings_dict = connection.settings_dict
    options, max_age = settings_dict["OPTIONS"], settings_dict["CONN_MAX_AGE"]
    connection.close()
    # Django's pool keeps the sessions itself and refuses persistent connections.
    settings_dict["CONN_MAX_AGE"] = 0
    options["pool"] = {"min_size": 1, "max_size": 1, "timeout": 10}
    try:
        yield
    finally:
        try:
            connection.close()
            connection.close_pool()
        finally:
            del options["pool"]
            settings_dict["CONN_MAX_AGE"] = max_age


def in_another_thread(work):
    """``work()`` on a thread of its own, so on a Django wrapper of its own."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(work())
        except Exception as exc:  # noqa: BLE001 - raised again on the test's thread
            outcome.append(exc)
        finally:
            connection.close()  # back to the pool

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert outcome, "the work on the other thread did not end"
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def backend() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def test_a_pooled_session_keeps_its_lane_from_one_wrapper_to_the_next(pooled):
    step = factories.Step(targets=3)
    factories.committed(step)
    session = backend()
    assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    prepared = lane_statements()
    assert prepared
    connection.close()
    # Another wrapper, the same session and the statements the first one prepared on it:
    # its lane must use them, not prepare them again under the same names.
    assert in_another_thread(backend) == session
    assert in_another_thread(lambda: cycle(step, step.targets[1])) == Settled(Outcome.FINISHED)
    assert cycle(step, step.targets[2]) == Settled(Outcome.FINISHED)
    assert backend() == session
    assert lane_statements() == prepared


@pytest.mark.parametrize("prepared", [True, False], ids=["lane", "cursor path"])
def test_a_pooled_session_is_told_the_timeline_setting_whoever_changed_it(
    pooled, settings, prepared
):
    settings.WORKFLOW_DELIVERY_PREPARED_STATEMENTS = prepared
    step = factories.Step(targets=3)
    _, quiet, recorded = (item.id for item in factories.committed(step))
    assert cycle(step, step.targets[0]) == Settled(Outcome.FINISHED)
    connection.close()
    with override_settings(WORKFLOW_DELIVERY_TIMELINE=False):
        # Another wrapper turns the session's recording off...
        finished = in_another_thread(lambda: released_cycle(step, step.targets[1]))
    assert finished == Settled(Outcome.FINISHED)
    # ...and this one, which last saw it recording, must turn it back on.
    assert released_cycle(step, step.targets[2]) == Settled(Outcome.FINISHED)

    assert kinds(quiet) == []
    assert kinds(recorded) == ["claimed", "released"]
