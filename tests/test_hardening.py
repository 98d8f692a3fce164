"""The faults of issue 10, each proven on real PostgreSQL with real second connections:
a sweep that never waits on a tenant, a reaper that never reads parked rows, huge
steps, the executor's proof, errors by SQLSTATE, the operator terminal, the locks
and checks the fence rests on, one-step lifecycle moves, one message per step and
lease checks by the statement's clock."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from tests import factories
from tests.locks import QUICK, wait_until_blocked
from tests.second_session import other
from workflow_delivery import checks, fence, services
from workflow_delivery.conf import LEASE_SECONDS_BOUND
from workflow_delivery.exceptions import (
    CommunityWriteFenced,
    InvalidLeaseSeconds,
    InvalidLifecycleTransition,
    IsolationLevelError,
    ProtocolError,
    StepIdentityClosed,
    StepMessageConflict,
    UnexpectedCommunityState,
)
from workflow_delivery.models import Community, Workflow, WorkflowAgentDelivery
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


def present(cursor, community: Community, *, local: bool) -> None:
    cursor.execute(
        "SELECT set_config('workflow_delivery.executor_community', %s, %s), "
        "set_config('workflow_delivery.executor_generation', %s, %s)",
        [str(community.id), local, str(community.deletion_fence_generation), local],
    )


def test_executor_settings_without_the_exclusive_lock_authorise_nothing(transactional_db):
    step = factories.Step(targets=1)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    frozen = Community.objects.get(pk=step.community.pk)
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        present(c, frozen, local=True)
        c.execute("DELETE FROM workflow_agent_deliveries WHERE community_id = %s", [frozen.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert WorkflowAgentDelivery.objects.filter(community=frozen).count() == 1


@pytest.mark.django_db(transaction=True)
def test_executor_settings_left_on_the_session_authorise_nothing_in_the_next_transaction():
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    frozen = Community.objects.get(pk=step.community.pk)
    try:
        with transaction.atomic(), connection.cursor() as c:
            # A real executor's transaction, but presenting session-wide.
            c.execute("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [frozen.id])
            c.execute(
                "SELECT wd_present_executor(%s, %s)", [frozen.id, frozen.deletion_fence_generation]
            )
            present(c, frozen, local=False)
            c.execute(
                "DELETE FROM workflow_agent_deliveries "
                "WHERE community_id = %s AND target_pubkey = %s",
                [frozen.id, step.targets[0]],
            )
        # Next transaction on the same (pooled) connection: the settings are still
        # there, the lock is gone.
        with (
            pytest.raises(DatabaseError) as caught,
            transaction.atomic(),
            connection.cursor() as c,
        ):
            c.execute("SELECT current_setting('workflow_delivery.executor_community')")
            assert c.fetchone()[0] == str(frozen.id)
            c.execute("DELETE FROM workflow_agent_deliveries WHERE community_id = %s", [frozen.id])
        assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    finally:
        with connection.cursor() as c:
            c.execute("RESET workflow_delivery.executor_community")
            c.execute("RESET workflow_delivery.executor_generation")
    assert WorkflowAgentDelivery.objects.filter(community=frozen).count() == 1


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


def writer_past_the_fence(step: factories.Step) -> Callable[[], list[uuid.UUID]]:
    """A producer that committed nothing yet: its rows are inserted, the fence passed."""
    ready, release = threading.Event(), threading.Event()

    def produce() -> list[uuid.UUID]:
        try:
            with transaction.atomic():
                created = services.commit_deliveries(
                    step.community.id, step.created_at, step.new_deliveries()
                )
                ready.set()
                release.wait(30)
            return created
        finally:
            connection.close()

    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(produce)
    assert ready.wait(30)

    def finish() -> list[uuid.UUID]:
        release.set()
        try:
            return future.result(timeout=30)
        finally:
            pool.shutdown()

    return finish


def test_deletion_waits_for_a_writer_past_the_fence_and_the_purge_sees_its_rows(worker):
    step = factories.Step(targets=3)
    finish_writer = writer_past_the_fence(step)

    def delete_tenant() -> dict[str, int]:
        generation = fence.transition_community(step.community.id, "quiescing")
        generation = fence.transition_community(step.community.id, "fenced")
        return fence.purge_community(step.community.id, generation)

    deleting = worker.submit(delete_tenant)
    wait_until_blocked(worker.pid)
    assert not deleting.done()
    assert len(finish_writer()) == 3
    deleted = deleting.result(timeout=30)
    assert deleted["workflow_agent_deliveries"] == 3
    assert not WorkflowAgentDelivery.objects.filter(community=step.community).exists()


def test_a_direct_state_update_waits_for_a_writer_past_the_fence(worker):
    step = factories.Step(targets=2)
    finish_writer = writer_past_the_fence(step)

    def raw_transition() -> None:
        with connection.cursor() as c:
            c.execute(
                "UPDATE communities SET deletion_state = 'quiescing' WHERE id = %s",
                [step.community.id],
            )

    moving = worker.submit(raw_transition)
    wait_until_blocked(worker.pid)
    assert Community.objects.get(pk=step.community.pk).deletion_state == "active"
    assert len(finish_writer()) == 2
    moving.result(timeout=30)
    assert Community.objects.get(pk=step.community.pk).deletion_state == "quiescing"


def test_a_transition_waits_for_a_transaction_that_asked_community_write_allowed(worker):
    owner = factories.community()
    with other() as reader:
        assert reader.execute("SELECT community_write_allowed(%s)", [owner.id]).fetchone()[0]
        moving = worker.submit(fence.transition_community, owner.id, "quiescing")
        wait_until_blocked(worker.pid)
        assert Community.objects.get(pk=owner.pk).deletion_state == "active"
        reader.commit()
    assert moving.result(timeout=30) == 1


@pytest.mark.django_db(transaction=True)
def test_a_repeatable_read_writer_cannot_write_into_a_tenant_fenced_after_its_snapshot():
    step = factories.Step(targets=1)
    with other() as writer:
        writer.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        writer.execute("SELECT count(*) FROM communities")  # the snapshot is taken here
        factories.move_to(step.community.id, "fenced")
        with pytest.raises(psycopg.Error) as caught:
            writer.execute(
                "INSERT INTO workflows (id, community_id, name, owner_pubkey, definition, "
                "status, created_at, updated_at) VALUES (gen_random_uuid(), %s, 'late', %s, "
                "'{}', 'active', now(), now())",
                [step.community.id, factories.key32()],
            )
        writer.rollback()
    assert "READ COMMITTED" in str(caught.value)
    assert Workflow.objects.filter(community=step.community).count() == 1


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


@pytest.mark.parametrize(
    ("path", "target"),
    [(["active"], "fenced"), (["active"], "tombstone"), (["quiescing"], "tombstone")],
)
def test_a_lifecycle_step_cannot_be_skipped(db, raw, path, target):
    owner = factories.community()
    factories.move_to(owner.id, path[-1])
    before = Community.objects.get(pk=owner.pk)
    with pytest.raises(InvalidLifecycleTransition):
        fence.transition_community(owner.id, target)
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("UPDATE communities SET deletion_state = %s WHERE id = %s", [target, owner.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_lifecycle_forward"
    after = Community.objects.get(pk=owner.pk)
    assert (after.deletion_state, after.deletion_fence_generation) == (
        before.deletion_state,
        before.deletion_fence_generation,
    )


def test_a_transition_from_a_state_the_caller_did_not_read_is_refused(db):
    owner = factories.community()
    fence.transition_community(owner.id, "quiescing")
    fence.transition_community(owner.id, "active")  # cancelled meanwhile
    with pytest.raises(UnexpectedCommunityState, match="is active, not quiescing"):
        fence.transition_community(owner.id, "quiescing", expected="quiescing")
    assert Community.objects.get(pk=owner.pk).deletion_state == "active"
    assert fence.transition_community(owner.id, "quiescing", expected="active") == 3


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


def test_a_fenced_write_names_its_community(db):
    step = factories.Step(targets=1)
    factories.move_to(step.community.id, "quiescing")
    with pytest.raises(CommunityWriteFenced) as caught:
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert caught.value.community_id == step.community.id


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


@pytest.mark.django_db(transaction=True)
def test_reversing_0006_restores_the_rules_of_0003():
    from django.core.management import call_command

    try:
        call_command("migrate", "workflow_delivery", "0005", verbosity=0)
        owner = factories.community()
        with connection.cursor() as c:
            # 0003's lifecycle: any forward move, a skipped step included.
            c.execute("UPDATE communities SET deletion_state = 'fenced' WHERE id = %s", [owner.id])
    finally:
        call_command("migrate", "workflow_delivery", verbosity=0)
    skipping = factories.community()
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as c:
        c.execute("UPDATE communities SET deletion_state = 'fenced' WHERE id = %s", [skipping.id])
