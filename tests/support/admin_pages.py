"""The admin's addresses and actions as the admin tests use them, and the rows they set up."""

from __future__ import annotations

import uuid

from django.contrib.auth.models import Permission
from django.urls import reverse

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import Lease

VIEW_PERMISSIONS = ["view_workflowagentdelivery", "view_community", "view_event"]


def changelist(model: type) -> str:
    return reverse(f"admin:workflow_delivery_{model._meta.model_name}_changelist")


def change(model: type, object_id: object) -> str:
    return reverse(f"admin:workflow_delivery_{model._meta.model_name}_change", args=[object_id])


def committed(step: factories.Step) -> list[uuid.UUID]:
    return services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())


def claim(step: factories.Step, target: bytes) -> Lease:
    lease, _ = services.claim_delivery(step.community.id, target)
    return lease


def expire(raw, delivery_id: uuid.UUID) -> None:
    """Stand in for time passing: the lease ran out a second ago by the database clock."""
    raw.execute(
        "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 second' "
        "WHERE id = %s",
        [delivery_id],
    )


def delivery(delivery_id: uuid.UUID) -> WorkflowAgentDelivery:
    return WorkflowAgentDelivery.objects.get(pk=delivery_id)


def run_action(client, model: type, action: str, ids: list) -> list[str]:
    response = client.post(
        changelist(model),
        {"action": action, "_selected_action": [str(i) for i in ids], "index": 0},
        follow=True,
    )
    assert response.status_code == 200
    return [str(message) for message in response.context["messages"]]


def listed(client, query: str = "", **params: str) -> list[uuid.UUID]:
    response = client.get(changelist(WorkflowAgentDelivery), {"q": query, **params})
    assert response.status_code == 200
    return [row.pk for row in response.context["cl"].result_list]


def grant(user, codename: str) -> None:
    user.user_permissions.add(Permission.objects.get(codename=codename))
