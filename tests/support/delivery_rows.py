"""One delivery's row and timeline as the tests read and write them: built, claimed, expired,
read back, and raw statements as a site's own SQL would send them."""

from __future__ import annotations

import uuid

from django.db import connection, transaction

from tests.support import factories
from workflow_delivery import history, services
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.store.errors import database_errors


def one_delivery() -> tuple[factories.Step, uuid.UUID]:
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)
    return step, delivery.id


def claim(step: factories.Step):
    claimed = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
    assert claimed is not None
    return claimed[0]


def expire(delivery_id: uuid.UUID) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 second' "
            "WHERE id = %s",
            [delivery_id],
        )


def row(delivery_id: uuid.UUID) -> dict:
    return WorkflowAgentDelivery.objects.values(
        "status", "attempts", "lease_generation", "finished_at", "lease_until"
    ).get(pk=delivery_id)


def entries(delivery_id: uuid.UUID) -> list[history.HistoryEntry]:
    """The delivery's history as the admin shows it."""
    return history.delivery_history(WorkflowAgentDelivery.objects.get(pk=delivery_id))


def timeline(delivery_id: uuid.UUID) -> list[tuple]:
    return [
        (e.kind, e.status_before, e.status_after, e.generation, e.actor)
        for e in entries(delivery_id)
    ]


def stored(delivery_id: uuid.UUID) -> list[str]:
    """The kinds of the timeline rows actually stored, oldest first."""
    rows = DeliveryTransition.objects.filter(delivery_id=delivery_id).order_by("id")
    return list(rows.values_list("kind", flat=True))


def raw_sql(statement: str, params: list) -> None:
    """A statement as a site's own SQL would send it; errors named by their constraint."""
    with transaction.atomic(), database_errors(), connection.cursor() as cursor:
        cursor.execute(statement, params)


def run_with_a_reap(step: factories.Step, delivery_id: uuid.UUID) -> None:
    claim(step)
    expire(delivery_id)
    services.reap_deliveries()
    services.finish_delivery(claim(step), "finished")


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
