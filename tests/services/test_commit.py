"""Committing a step's deliveries: a step of ten thousand targets commits whole and once, a
one-call commit waits for an open identity block of the same step, a second message for a
step is refused with nothing written, an identity's commit after its block is refused, and
so is a caller in a repeatable-read transaction."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import DatabaseError, connection, transaction

from tests.support import factories
from tests.support.delivery_rows import COPY_DELIVERIES, counts, run_raw
from tests.support.locks import wait_until_blocked
from workflow_delivery import services
from workflow_delivery.exceptions import (
    IsolationLevelError,
    StepIdentityClosed,
    StepMessageConflict,
)
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import NewDelivery


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


def test_step_identity_commit_after_its_block_is_refused(db):
    step = factories.Step(targets=1)
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
        pass
    with pytest.raises(StepIdentityClosed, match="block has closed"):
        identity.commit(step.created_at, step.new_deliveries())
    assert not WorkflowAgentDelivery.objects.filter(run=step.run).exists()


@pytest.mark.django_db
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


@pytest.mark.django_db
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
