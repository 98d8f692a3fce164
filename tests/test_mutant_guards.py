"""Behaviours only a targeted test pins: each fails if its guard is removed."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connection, transaction

from tests import factories
from tests.second_session import other
from tests.test_consumer import Running, consumer_for
from workflow_delivery import fence, services
from workflow_delivery.models import WorkflowAgentDelivery


@pytest.mark.django_db(transaction=True)
def test_a_claim_takes_the_next_pending_row_while_the_oldest_is_locked():
    target = factories.key32()
    first = factories.Step(targets=[target], step_id="step-1")
    factories.committed(first)
    second = factories.Step(owner=first.community, targets=[target], step_id="step-2")
    factories.committed(second)
    oldest, newer = (
        WorkflowAgentDelivery.objects.filter(community=first.community, target_pubkey=target)
        .order_by("created_at", "id")
        .values_list("id", flat=True)
    )
    with other() as conn:
        try:
            conn.execute(
                "SELECT id FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE", [oldest]
            )
            # A claim that waited for the locked row would fail here instead of hanging.
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '3s'")
            claimed = services.claim_delivery(first.community.id, target)
        finally:
            conn.rollback()
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    assert claimed is not None
    assert claimed[0].delivery_id == newer


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
    assert fence.begin_deletion(step.community.id) >= 1


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
                fence.begin_deletion(step.community.id)
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


@pytest.mark.django_db(transaction=True)
def test_a_renew_that_meets_the_handlers_own_block_leaves_the_lease_live():
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)
    seen_lost: list[bool] = []

    def long_block(record, lease, context) -> None:
        # The block holds the row across at least one beat (every 2/3 s), whose renew
        # then times out behind it: busy, and the lease still the handler's. The block
        # does not settle, so the consumer finishes the delivery after the handler.
        with context.holding():
            time.sleep(1.5)
        seen_lost.append(context.lost.is_set())

    consumer = consumer_for(step, long_block, lease_seconds=2, max_deliveries=1)
    with Running(consumer) as running:
        stats = running.join(20)
    assert stats.renew_busy >= 1, stats
    assert seen_lost == [False]
    assert stats.finished == 1 and stats.lost == 0, stats
    assert WorkflowAgentDelivery.objects.get(pk=delivery.id).status == "finished"
