"""Behaviours only a targeted test pins: each fails if its guard is removed."""

from __future__ import annotations

import pytest
from django.db import connection

from tests import factories
from tests.test_hardening import other
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
