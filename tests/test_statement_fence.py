"""Migration 0010: the fence's INSERT check runs once per statement, over the
statement's new rows, and still refuses what the row trigger did. A pending commit
stores no timeline entry (migration 0017: the row implies it); a commit under a
named actor stores one."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, transaction

from tests import factories
from workflow_delivery import fence, history, services
from workflow_delivery.exceptions import CommunityWriteFenced, StepMessageConflict
from workflow_delivery.models import Community, DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import NewDelivery

pytestmark = pytest.mark.django_db

# Copies every delivery of the named communities as a new step of the same run: one
# raw statement writing rows of several communities at once.
COPY_DELIVERIES = """
INSERT INTO workflow_agent_deliveries (
    id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
    message_event_id, message_event_created_at, cause_kind, cause_event_id,
    cause_scheduled_for, cause_webhook_invocation_id)
SELECT gen_random_uuid(), community_id, workflow_id, run_id, step_id || '-copy', target_pubkey,
       definition_event_id, message_event_id, message_event_created_at, cause_kind,
       cause_event_id, cause_scheduled_for, cause_webhook_invocation_id
  FROM workflow_agent_deliveries
 WHERE community_id = ANY(%s::uuid[])
"""


def counts() -> tuple[int, int]:
    return WorkflowAgentDelivery.objects.count(), DeliveryTransition.objects.count()


def run_raw(statement: str, params: list) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


@pytest.mark.parametrize("state", ["quiescing", "fenced", "tombstone"])
def test_one_statement_writing_to_an_active_and_a_frozen_community_writes_nothing(state):
    healthy, frozen = factories.Step(targets=3), factories.Step(targets=2)
    factories.committed(healthy)
    factories.committed(frozen)
    factories.move_to(frozen.community.id, state)
    before = counts()
    with pytest.raises(DatabaseError) as caught:
        run_raw(COPY_DELIVERIES, [[str(healthy.community.id), str(frozen.community.id)]])
    error = caught.value.__cause__
    assert error.diag.constraint_name == "wd_community_write_fence"
    assert error.diag.table_name == "workflow_agent_deliveries"
    assert f"{frozen.community.id} ({frozen.community.host}) is {state}" in str(error)
    assert "INSERT on workflow_agent_deliveries" in str(error)
    assert counts() == before


def test_a_statement_into_active_communities_stores_no_committed_entry():
    first, second = factories.Step(targets=3), factories.Step(targets=4)
    factories.committed(first)
    factories.committed(second)
    assert run_raw(COPY_DELIVERIES, [[str(first.community.id), str(second.community.id)]]) == 7
    copies = WorkflowAgentDelivery.objects.filter(step_id__endswith="-copy")
    assert copies.count() == 7
    assert not DeliveryTransition.objects.filter(delivery__in=copies).exists()
    for copy in copies:
        (entry,) = history.delivery_history(copy)
        # A raw statement names no actor: the producer is assumed.
        assert (entry.kind, entry.status_after, entry.generation, entry.actor, entry.at) == (
            "committed", "pending", 0, "producer", copy.created_at,
        )  # fmt: skip


def test_a_committed_entry_names_the_actor_the_session_set():
    step = factories.Step(targets=2)
    factories.committed(step)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:ada', true)")
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
    copies = WorkflowAgentDelivery.objects.filter(step_id__endswith="-copy")
    assert set(
        DeliveryTransition.objects.filter(delivery__in=copies).values_list("actor", flat=True)
    ) == {"operator:ada"}


def test_a_committed_entry_under_a_named_actor_is_stored_first():
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:ada', true)")
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
        # Transaction-local, and the test's transaction goes on.
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    copy = WorkflowAgentDelivery.objects.get(step_id__endswith="-copy")
    services.finish_delivery(
        services.claim_delivery(step.community.id, step.targets[0], delivery_id=copy.id)[0],
        "finished",
    )
    copy.refresh_from_db()
    shown = [(e.kind, e.actor, e.stored) for e in history.delivery_history(copy)]
    assert shown == [
        ("committed", "operator:ada", True),
        ("claimed", "holder", False),
        ("finished", "holder", False),
    ]


def test_the_executor_of_a_fenced_community_may_still_insert():
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "quiescing")
    factories.move_to(step.community.id, "fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    before = counts()
    with fence.executor_writes(step.community.id, generation), connection.cursor() as cursor:
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
    assert counts() == (before[0] + 2, before[1])


def test_a_retry_into_a_frozen_community_is_refused_by_the_service():
    """Every row of the retry is skipped, so no row reaches the statement trigger: the
    producer's statement asks the fence itself."""
    step = factories.Step(targets=3)
    deliveries = factories.committed(step)
    factories.move_to(step.community.id, "quiescing")
    before = counts()
    with pytest.raises(CommunityWriteFenced, match=str(step.community.id)):
        services.commit_deliveries(step.community.id, step.created_at, deliveries)
    with (
        pytest.raises(CommunityWriteFenced),
        services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity,
    ):
        assert identity.exists
        identity.commit(step.created_at, deliveries)
    assert counts() == before


def test_a_raw_insert_whose_every_row_is_skipped_writes_nothing_in_a_frozen_community():
    """A statement-level fence sees no row to refuse: such a statement succeeds, and
    it writes nothing."""
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    before = counts()
    skipped = COPY_DELIVERIES.replace("step_id || '-copy'", "step_id").replace(
        "gen_random_uuid()", "id"
    )
    assert run_raw(skipped + " ON CONFLICT DO NOTHING", [[str(step.community.id)]]) == 0
    assert counts() == before


def test_a_retry_with_another_message_is_refused():
    """Every row of the retry is skipped, yet the row trigger saw each before."""
    step = factories.Step(targets=2)
    factories.committed(step)
    other = factories.message(step.community, step.targets)
    retry = [
        NewDelivery(uuid.uuid4(), step.binding(target, message_event_id=bytes(other.id)))
        for target in step.targets
    ]
    before = counts()
    with pytest.raises(StepMessageConflict, match=bytes(other.id).hex()):
        services.commit_deliveries(step.community.id, other.created_at, retry)
    with (
        pytest.raises(StepMessageConflict),
        services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity,
    ):
        identity.commit(other.created_at, retry)
    assert counts() == before


def test_one_statement_giving_a_new_step_two_messages_is_refused():
    step = factories.Step(targets=2)
    factories.committed(step)
    other = factories.message(step.community, step.targets)
    before = counts()
    # The copies form a new step; the second copy carries another message.
    two_messages = COPY_DELIVERIES.replace(
        "message_event_id, message_event_created_at, cause_kind,\n       cause_event_id",
        "CASE WHEN target_pubkey = %s THEN %s ELSE message_event_id END, "
        "message_event_created_at, cause_kind,\n       cause_event_id",
        1,
    )
    assert two_messages != COPY_DELIVERIES
    with pytest.raises(DatabaseError) as caught:
        run_raw(two_messages, [step.targets[1], bytes(other.id), [str(step.community.id)]])
    assert caught.value.__cause__.diag.constraint_name == "wd_delivery_one_message_per_step"
    assert counts() == before


PER_STATEMENT = [
    "wd_require_community_write",
    "wd_enforce_community_write_fence_on_insert",
]
NOT_FOR_INSERTS = ["wd_enforce_community_write_fence", "wd_record_delivery_departure"]


def test_a_large_step_runs_the_fence_once_per_statement_and_the_timeline_never():
    """The fence, counted by PostgreSQL's own function statistics for this
    transaction: no call per row, and none of the timeline's function."""
    step = factories.Step(targets=2000)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL track_functions = 'pl'")
        created = services.commit_deliveries(
            step.community.id, step.created_at, step.new_deliveries()
        )
        cursor.execute(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE funcname = ANY(%s)",
            [PER_STATEMENT + NOT_FOR_INSERTS],
        )
        calls = dict(cursor.fetchall())
    assert len(created) == 2000
    # The service's statement asks the fence itself, and the deliveries' statement
    # trigger asks again.
    assert calls == {
        "wd_require_community_write": 2,
        "wd_enforce_community_write_fence_on_insert": 1,
    }
