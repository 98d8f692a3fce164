"""Behaviours only a targeted test pins: each fails if its guard is removed."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from tests import factories
from tests.second_session import other
from tests.test_consumer import Running, consumer_for
from workflow_delivery import services
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
