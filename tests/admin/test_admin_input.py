"""Crafted input to the admin as a staff user: a 400 or the admin's own "invalid
lookup" redirect (``?e=1``), never a 500."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.admin import delivery as delivery_admin
from workflow_delivery.admin import shared as shared_admin
from workflow_delivery.models import Community, Event, StatementTimestamp, WorkflowAgentDelivery

pytestmark = pytest.mark.django_db


def changelist(model: type) -> str:
    return reverse(f"admin:workflow_delivery_{model._meta.model_name}_changelist")


NOT_KEYS = ["not-a-uuid", "' OR 1=1 --", "a\x00b", "9" * 5000]


@pytest.mark.parametrize("value", NOT_KEYS, ids=["not-a-uuid", "sql", "nul", "5000-digits"])
@pytest.mark.parametrize(
    ("model", "action"),
    [
        (WorkflowAgentDelivery, "release_leases"),
        (WorkflowAgentDelivery, "mark_failed"),
        (Community, "begin_deletion"),
    ],
)
def test_an_action_on_something_that_is_not_a_key_is_a_400(admin_client, model, action, value):
    step = factories.Step(targets=1)
    factories.committed(step)
    before = list(WorkflowAgentDelivery.objects.values()), list(Community.objects.values())
    response = admin_client.post(
        changelist(model), {"action": action, "_selected_action": [value], "index": 0}
    )
    assert response.status_code == 400
    assert (
        list(WorkflowAgentDelivery.objects.values()),
        list(Community.objects.values()),
    ) == before


@pytest.mark.parametrize(
    ("model", "lookup", "value"),
    [
        (WorkflowAgentDelivery, "status__exact", "\x00"),
        (WorkflowAgentDelivery, "target_pubkey__exact", "zz"),
        (WorkflowAgentDelivery, "created_at__year", "99999"),
        (WorkflowAgentDelivery, "step_id__regex", "("),
        (Event, "content__regex", "("),
        (Event, "tags__has_key", "\x00"),
        (Event, "content__exact", "\x00"),
        (Community, "host__exact", "\x00"),
    ],
)
def test_a_crafted_list_lookup_is_refused_never_a_500(admin_client, model, lookup, value):
    factories.committed(factories.Step(targets=1))
    response = admin_client.get(changelist(model), {lookup: value})
    assert response.status_code in (302, 400), response.status_code
    if response.status_code == 302:
        assert response.url.endswith("?e=1")


def test_a_search_with_a_nul_is_refused_never_a_500(admin_client):
    response = admin_client.get(changelist(WorkflowAgentDelivery), {"q": "a\x00b"})
    assert response.status_code in (200, 302, 400)


def expired_rows(count: int) -> list:
    step = factories.Step(targets=count)
    ids = [d.id for d in factories.committed(step)]
    for target in step.targets:
        services.claim_delivery(step.community.id, target)
    WorkflowAgentDelivery.objects.filter(id__in=ids).update(
        lease_until=StatementTimestamp() - timedelta(seconds=1)
    )
    return ids


@pytest.mark.parametrize("across", [False, True], ids=["selected", "select all"])
def test_an_action_on_more_rows_than_a_request_acts_on_is_refused(
    admin_client, monkeypatch, across
):
    monkeypatch.setattr(shared_admin, "MAX_ACTION_ROWS", 2)
    ids = expired_rows(3)
    data = {"action": "mark_failed", "_selected_action": [str(i) for i in ids], "index": 0}
    if across:
        data.update(select_across="1", _selected_action=[str(ids[0])])
    response = admin_client.post(changelist(WorkflowAgentDelivery), data, follow=True)
    assert response.status_code == 200
    (message,) = [str(m) for m in response.context["messages"]]
    assert "at most 2 rows per request; 3 were selected" in message
    assert set(WorkflowAgentDelivery.objects.values_list("status", flat=True)) == {"claimed"}
    assert not LogEntry.objects.exists()


def test_the_reap_action_runs_a_bounded_set_of_batches_without_rests(
    admin_client, monkeypatch, settings
):
    monkeypatch.setattr(delivery_admin, "REAP_ACTION_BATCHES", 2)
    settings.WORKFLOW_DELIVERY_REAP_BATCH_SIZE = 2
    settings.WORKFLOW_DELIVERY_REAP_YIELD_RATIO = 100.0
    ids = expired_rows(7)

    def no_rest(seconds: float) -> None:
        pytest.fail("the reap action rested inside the request")

    monkeypatch.setattr("workflow_delivery.services.maintenance.time.sleep", no_rest)
    response = admin_client.post(
        changelist(WorkflowAgentDelivery),
        {"action": "reap_expired_leases", "_selected_action": [str(ids[0])], "index": 0},
        follow=True,
    )
    assert response.status_code == 200
    statuses = list(WorkflowAgentDelivery.objects.values_list("status", flat=True))
    assert statuses.count("pending") == 4
    assert statuses.count("claimed") == 3
