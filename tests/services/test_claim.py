"""A claim never waits on a row another session has locked: it takes the next pending one
at once."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from tests.support import factories
from tests.support.locks import QUICK
from tests.support.second_session import other
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery


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
