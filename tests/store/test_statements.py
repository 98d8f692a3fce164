"""How the app runs its statements: prepared by default, or through Django's cursor
when asked, with the same results and errors either way. The cheap path keeps every
guarantee of the careful one: records read back are the values a validated constructor
builds, the reused cursor never mixes two statements' results, and Django's connection
rules still hold."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.db import connection, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.conf import app_settings
from workflow_delivery.exceptions import CommunityWriteFenced, ProtocolError
from workflow_delivery.protocol import (
    DeliveryBinding,
    DeliveryStatus,
    EventCause,
    NewDelivery,
    Outcome,
    ScheduleCause,
    Settled,
    WebhookCause,
)
from workflow_delivery.store import run as store_run
from workflow_delivery.store.statement import Statement

CAUSES = [
    EventCause(b"\x07" * 32),
    # Given in another offset: a constructed cause holds it in UTC, so must a stored one.
    ScheduleCause(datetime(2030, 5, 6, 7, 8, 9, tzinfo=timezone(timedelta(hours=5)))),
    WebhookCause(uuid.UUID("6f1d1e3c-8a0b-4e55-9d55-6d2c3f1b2a90")),
]


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("cause", CAUSES, ids=["event", "schedule", "webhook"])
def test_a_stored_record_is_the_value_a_validated_constructor_builds(db, cause, prepared):
    step = factories.Step()
    binding = step.binding(cause=cause)
    delivery_id = uuid.uuid4()
    services.commit_deliveries(
        step.community.id, step.created_at, [NewDelivery(delivery_id, binding)]
    )
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared):
        stored = services.get_delivery(step.community.id, delivery_id).binding
        _, claimed = services.claim_delivery(step.community.id, binding.target_pubkey)
    validated = DeliveryBinding(
        **{name: getattr(stored, name) for name in DeliveryBinding.__dataclass_fields__}
    )
    for record_binding in (stored, claimed.binding):
        assert record_binding == binding == validated
        assert hash(record_binding) == hash(validated)
        assert repr(record_binding) == repr(validated)
        for name in DeliveryBinding.__dataclass_fields__:
            assert type(getattr(record_binding, name)) is type(getattr(validated, name)), name
    assert type(claimed.status) is DeliveryStatus
    assert claimed.status is DeliveryStatus.CLAIMED
    if isinstance(cause, ScheduleCause):
        assert stored.cause.scheduled_for.tzinfo is UTC


def test_data_coming_in_is_still_validated(db):
    step = factories.Step()
    with pytest.raises(ProtocolError) as caught:
        services.claim_delivery(step.community.id, b"short")
    assert caught.value.field == "target_pubkey"
    with pytest.raises(ProtocolError) as caught:
        step.binding(step_id="   ")
    assert caught.value.field == "step_id"


# What a test of the prepared path needs, whatever the run's setting says (the nox
# cell with nothing prepared turns it off).
PREPARED = override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=True)


def scope() -> store_run._Scope:
    """One statement's use of the runner's cursor (what ``run.fetch`` enters)."""
    return store_run._Scope("default", savepoint=True)


@pytest.mark.psycopg3  # the reused cursor is psycopg 3's
@PREPARED
def test_a_scope_inside_another_gets_its_own_cursor(db):
    with scope() as outer:
        outer.execute("SELECT generate_series(1, 3)")
        with scope() as inner:
            assert inner is not outer
            inner.execute("SELECT 42")
            assert inner.fetchone() == (42,)
        assert outer.fetchall() == [(1,), (2,), (3,)]
    with scope() as again:
        assert again is outer
    assert store_run.session_of(connection, connection.connection).cursor is outer


@pytest.mark.psycopg3  # the lane and the reused cursor are psycopg 3's
@PREPARED
def test_a_reconnected_wrapper_starts_a_fresh_session(transactional_db):
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    first = connection.connection
    known = store_run.session_of(connection, first)
    assert known.lane is not None and known.pooled is False
    connection.close()
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
    second = connection.connection
    assert second is not first
    fresh = store_run.session_of(connection, second)
    assert fresh is not known
    assert fresh.lane is not None and fresh.lane.raw is second
    # Nothing of the session is kept on Django's wrapper.
    assert not [name for name in vars(connection) if "workflow_delivery" in name]


def test_statements_run_again_after_the_connection_is_reopened(transactional_db):
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    connection.close()
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
    lease, _ = services.claim_delivery(step.community.id, step.targets[1])
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def test_a_connection_shared_between_threads_never_lends_one_cursor_twice(transactional_db):
    seen: list[object] = []
    connection.inc_thread_sharing()
    try:

        def use() -> None:
            with scope() as cursor:
                seen.append(cursor)

        use()
        thread = threading.Thread(target=use)
        thread.start()
        thread.join(timeout=30)
    finally:
        connection.dec_thread_sharing()
    assert len(seen) == 2 and seen[0] is not seen[1]


def test_a_connection_of_another_thread_is_refused(transactional_db):
    ours = connections["default"]
    ours.ensure_connection()
    errors: list[BaseException] = []

    def use() -> None:
        try:
            # This thread's handler would open its own connection; hand it ours.
            connections["default"] = ours
            store_run.fetch("default", Statement("SELECT 1"))
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join(timeout=30)
    assert len(errors) == 1 and "thread" in str(errors[0])


def test_a_broken_transaction_is_detected_before_the_statement(db):
    step = factories.Step()
    factories.committed(step)
    with transaction.atomic():
        connection.needs_rollback = True
        with pytest.raises(TransactionManagementError):
            services.claim_delivery(step.community.id, step.targets[0])
        connection.needs_rollback = False


def test_settings_are_read_again_after_an_override(db):
    assert app_settings.DEFAULT_LEASE_SECONDS == 60
    with override_settings(WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS=17):
        assert app_settings.DEFAULT_LEASE_SECONDS == 17
    assert app_settings.DEFAULT_LEASE_SECONDS == 60


@pytest.mark.psycopg3  # the reused cursor is psycopg 3's
@PREPARED
def test_the_reused_cursor_serves_again_after_a_refused_statement(db):
    healthy, frozen = factories.Step(), factories.Step()
    factories.committed(healthy)
    factories.committed(frozen)
    services.transition_community(frozen.community.id, "quiescing")
    with scope() as before:
        pass
    with transaction.atomic(), pytest.raises(CommunityWriteFenced):
        # In a transaction: on the cursor path.
        services.claim_delivery(frozen.community.id, frozen.targets[0])
    with scope() as after:
        assert after is before
    lease, _ = services.claim_delivery(healthy.community.id, healthy.targets[0])
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def cycle(step: factories.Step) -> Settled:
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    return services.finish_delivery(lease, Outcome.FINISHED)


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [statement for (statement,) in cursor.fetchall()]


@pytest.mark.psycopg3
@PREPARED
def test_claim_and_finish_are_prepared_with_a_literal_pending(db):
    assert cycle(factories.Step()) == Settled(Outcome.FINISHED)
    statements = prepared_statements()
    claim = [text for text in statements if "FOR UPDATE SKIP LOCKED" in text]
    assert claim, statements
    # A literal lets the generic plan use the partial claim index.
    assert "status = 'pending'" in claim[0]
    settle = "SET status = $1, finished_at = statement_timestamp()"
    assert any(settle in text for text in statements)


@pytest.mark.psycopg3
@PREPARED
def test_prepared_statements_bypass_django_query_capture(db):
    step = factories.Step()
    with CaptureQueriesContext(connection) as captured:
        cycle(step)
    assert not any("SKIP LOCKED" in query["sql"] for query in captured.captured_queries)


@override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=False)
def test_setting_off_runs_through_djangos_cursor(db):
    step = factories.Step()
    with CaptureQueriesContext(connection) as captured:
        assert cycle(step) == Settled(Outcome.FINISHED)
    sql = [query["sql"] for query in captured.captured_queries]
    assert any("SKIP LOCKED" in text for text in sql)
    assert any("finished_at = statement_timestamp()" in text for text in sql)


@pytest.mark.parametrize("prepared", [True, False])
def test_fence_errors_map_the_same_either_way(db, prepared):
    step = factories.Step()
    factories.committed(step)
    services.transition_community(step.community.id, "quiescing")
    with (
        override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared),
        pytest.raises(CommunityWriteFenced),
    ):
        services.claim_delivery(step.community.id, step.targets[0])


@pytest.mark.parametrize("prepared", [True, False])
def test_a_refused_statement_leaves_the_callers_transaction_usable(db, prepared):
    healthy, frozen = factories.Step(), factories.Step()
    services.transition_community(frozen.community.id, "quiescing")
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared), transaction.atomic():
        with pytest.raises(CommunityWriteFenced):
            services.commit_deliveries(
                frozen.community.id, frozen.created_at, frozen.new_deliveries()
            )
        created = services.commit_deliveries(
            healthy.community.id, healthy.created_at, healthy.new_deliveries()
        )
    assert len(created) == 1
    assert services.get_delivery(healthy.community.id, created[0]) is not None
