"""The locks the write fence rests on, with a second session in the middle: a deletion or a
raw change of state waits for a writer past the fence (and the purge then sees its rows),
a write past the fence holds the deletion lock back to its commit, a write waits for a
deletion in progress and is then refused, and a repeatable-read writer cannot write into a
tenant fenced after its snapshot."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from django.db import connection, transaction

from tests.support import factories
from tests.support.locks import wait_until_blocked
from tests.support.second_session import other
from workflow_delivery import services
from workflow_delivery.models import Community, Workflow, WorkflowAgentDelivery


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
        generation = services.transition_community(step.community.id, "quiescing")
        generation = services.transition_community(step.community.id, "fenced")
        return services.purge_community(step.community.id, generation)

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
        moving = worker.submit(services.transition_community, owner.id, "quiescing")
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


# Raw writes, so only the fence's own trigger guards them: the app's statements take the
# shared deletion lock themselves before they lock a row. The timeline is off: its
# entries are written under the same lock, which would take it for the trigger.
_RAW_WRITES = {
    "claim": (
        "UPDATE workflow_agent_deliveries SET status = 'claimed', "
        "lease_generation = lease_generation + 1, claimed_at = now(), "
        "lease_until = now() + interval '1 minute' WHERE community_id = %s"
    ),
    "delete": "DELETE FROM workflow_agent_deliveries WHERE community_id = %s",
    "run": "UPDATE workflow_runs SET id = id WHERE community_id = %s",
}


def _timeline_off(conn) -> None:
    conn.execute("SELECT set_config('workflow_delivery.timeline', 'off', false)")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", list(_RAW_WRITES))
def test_a_write_past_the_fence_holds_back_the_deletion_lock_to_its_commit(write):
    step = factories.Step(targets=2)
    factories.committed(step)
    with other() as conn:
        try:
            _timeline_off(conn)
            conn.execute(_RAW_WRITES[write], [step.community.id])
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_try_advisory_xact_lock(wd_community_deletion_key(%s))",
                    [step.community.id],
                )
                assert cursor.fetchone()[0] is False
        finally:
            conn.rollback()
    # Once the write has ended, the executor's lock is free.
    assert services.begin_deletion(step.community.id) >= 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", list(_RAW_WRITES))
def test_a_write_waits_for_a_deletion_in_progress_and_is_then_refused(write):
    step = factories.Step(targets=2)
    factories.committed(step)
    with other() as conn:
        try:
            _timeline_off(conn)
            conn.commit()
            with transaction.atomic():
                # The transition holds the exclusive lock until this block commits.
                services.begin_deletion(step.community.id)
                conn.execute("SET LOCAL lock_timeout = '1s'")
                # The write waits for the transition (a lock timeout ends the wait),
                # never reading the community as still active.
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    conn.execute(_RAW_WRITES[write], [step.community.id])
                conn.rollback()
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as refused:
                conn.execute(_RAW_WRITES[write], [step.community.id])
            assert refused.value.diag.constraint_name == "wd_community_write_fence"
        finally:
            conn.rollback()
