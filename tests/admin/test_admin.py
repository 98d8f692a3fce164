"""The admin through Django's test client: read-only pages, hex keys, search and
filters, and operator actions that go through the services and the fence."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tests.support import factories
from tests.support.admin_pages import (
    change,
    changelist,
    claim,
    committed,
    delivery,
    expire,
    grant,
    listed,
    run_action,
)
from workflow_delivery import services
from workflow_delivery.models import Community, Event, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus, LeaseLost, Outcome

pytestmark = pytest.mark.django_db


def test_superuser_sees_the_delivery_list_and_a_detail_with_every_field(admin_client, step):
    first, *_ = committed(step)
    claim(step, step.targets[0])

    page = admin_client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert str(first)[:8] in page
    assert step.targets[0].hex()[:12] in page
    assert step.community.host in page

    detail = admin_client.get(change(WorkflowAgentDelivery, first)).content.decode()
    for value in (
        step.targets[0].hex(),
        step.definition_event_id.hex(),
        step.cause.event_id.hex(),
        step.step_id,
        change(Event, bytes(step.message.id).hex()),
        change(Community, step.community.id),
        change(type(step.workflow), step.workflow.id),
        change(type(step.run), step.run.id),
    ):
        assert value in detail


def test_event_pages_address_the_event_by_its_hex_id(admin_client, step):
    key = bytes(step.message.id).hex()

    detail = admin_client.get(change(Event, key))
    assert detail.status_code == 200
    assert bytes(step.message.pubkey).hex() in detail.content.decode()
    assert reverse("admin:workflow_delivery_event_history", args=[key]) in detail.content.decode()
    assert change(Event, key) in admin_client.get(changelist(Event)).content.decode()
    assert admin_client.get(change(Event, key.upper())).status_code == 200
    assert admin_client.get(change(Event, "not-hex")).status_code == 302


@pytest.mark.parametrize("model", [WorkflowAgentDelivery, Community])
def test_no_form_adds_changes_or_deletes_a_row(admin_client, step, model):
    first, *_ = committed(step)
    pk = first if model is WorkflowAgentDelivery else step.community.id
    before = model.objects.filter(pk=pk).values().get()
    name = model._meta.model_name

    if model is not Community:  # the one add form: test_create_community.py
        assert admin_client.get(reverse(f"admin:workflow_delivery_{name}_add")).status_code == 403
    edit = {"status": "failed", "deletion_state": "tombstone", "host": "renamed.example"}
    assert admin_client.post(change(model, pk), edit).status_code == 403
    delete = reverse(f"admin:workflow_delivery_{name}_delete", args=[pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert model.objects.filter(pk=pk).values().get() == before


@pytest.mark.parametrize(
    ("action", "codename"),
    [
        ("release_leases", "release_delivery"),
        ("mark_failed", "fail_delivery"),
        ("reap_expired_leases", "reap_deliveries"),
        ("retry_failed", "retry_delivery"),
    ],
)
def test_a_delivery_action_needs_its_own_permission(client, viewer, step, raw, action, codename):
    first, *_ = committed(step)
    claim(step, step.targets[0])
    expire(raw, first)
    before = WorkflowAgentDelivery.objects.filter(pk=first).values().get()
    others = {"release_leases", "mark_failed", "reap_expired_leases", "retry_failed"} - {action}

    page = client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert f'value="{action}"' not in page
    run_action(client, WorkflowAgentDelivery, action, [first])
    assert WorkflowAgentDelivery.objects.filter(pk=first).values().get() == before

    grant(viewer, codename)
    page = client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert f'value="{action}"' in page
    assert not any(f'value="{other}"' in page for other in others)


@pytest.mark.parametrize(
    ("action", "codename", "path"),
    [
        ("begin_deletion", "begin_community_deletion", []),
        ("fence_communities", "fence_community", ["quiescing"]),
        ("tombstone", "tombstone_community", ["quiescing", "fenced"]),
        ("cancel_deletion", "cancel_community_deletion", ["quiescing"]),
    ],
)
def test_a_community_action_needs_its_own_permission(client, viewer, action, codename, path):
    community = factories.community()
    for state in path:
        factories.move_to(community.id, state)
    before = Community.objects.filter(pk=community.id).values().get()

    assert f'value="{action}"' not in client.get(changelist(Community)).content.decode()
    run_action(client, Community, action, [community.id])
    assert Community.objects.filter(pk=community.id).values().get() == before

    grant(viewer, codename)
    assert f'value="{action}"' in client.get(changelist(Community)).content.decode()
    assert run_action(client, Community, action, [community.id])[0].endswith("1 done, 0 skipped.")


def test_release_bumps_the_generation_and_fences_out_the_holder(admin_client, admin_user, step):
    first, *_ = committed(step)
    lease = claim(step, step.targets[0])

    reported = run_action(admin_client, WorkflowAgentDelivery, "release_leases", [first])

    assert reported == ["Release lease: 1 done, 0 skipped."]
    row = delivery(first)
    assert (row.status, row.lease_generation) == (DeliveryStatus.PENDING, lease.generation + 1)
    assert services.renew_delivery(lease) == LeaseLost()
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    entry = LogEntry.objects.get(object_id=str(first))
    assert (entry.user, entry.action_flag) == (admin_user, CHANGE)
    assert "Released by an operator" in entry.change_message


def test_mark_failed_is_an_operator_terminal_of_non_terminal_rows(admin_client, step):
    pending, claimed, finished = committed(step)
    claim(step, step.targets[1])
    services.finish_delivery(claim(step, step.targets[2]), Outcome.FINISHED)

    reported = run_action(
        admin_client, WorkflowAgentDelivery, "mark_failed", [pending, claimed, finished]
    )

    assert reported == ["Mark failed: 2 done, 1 skipped (1 already terminal)."]
    statuses = {i: delivery(i).status for i in (pending, claimed, finished)}
    assert statuses == {pending: "failed", claimed: "failed", finished: "finished"}
    assert delivery(pending).finished_at is not None
    logged = LogEntry.objects.filter(change_message__contains="operator terminal")
    assert sorted(logged.values_list("object_id", flat=True)) == sorted(
        [str(pending), str(claimed)]
    )


def test_retry_asks_why_then_retries_the_failed_rows_only(admin_client, admin_user, step):
    failed, finished, pending = committed(step)
    held = claim(step, step.targets[0])
    services.finish_delivery(held, Outcome.FAILED, error="smtp down")
    services.finish_delivery(claim(step, step.targets[1]), Outcome.FINISHED)
    chosen = [str(i) for i in (failed, finished, pending)]
    url = changelist(WorkflowAgentDelivery)
    asked = admin_client.post(url, {"action": "retry_failed", "_selected_action": chosen})
    assert asked.status_code == 200 and 'name="reason"' in asked.content.decode()
    assert delivery(failed).status == "failed"
    blank = {"action": "retry_failed", "_selected_action": chosen, "apply": "1", "reason": " "}
    assert "Say why" in admin_client.post(url, blank).content.decode()
    assert delivery(failed).status == "failed"

    answer = admin_client.post(url, {**blank, "reason": "smtp is back"}, follow=True)

    reported = [str(message) for message in answer.context["messages"]]
    assert reported == [
        "Retry: 1 done, 2 skipped (1 finished, never reopened, 1 pending, not failed)."
    ]
    row = delivery(failed)
    assert (row.status, row.lease_generation) == ("pending", held.generation + 1)
    assert delivery(finished).status == "finished"
    entry = row.timeline.latest("id")
    assert (entry.kind, entry.actor, entry.reason) == (
        "operator_retried",
        f"operator:{admin_user.get_username()}",
        "smtp is back",
    )
    assert LogEntry.objects.get(object_id=str(failed)).user == admin_user


def test_retry_without_its_permission_changes_nothing_even_when_posted(client, viewer, step):
    first, *_ = committed(step)
    services.finish_delivery(claim(step, step.targets[0]), Outcome.FAILED)
    posted = {
        "action": "retry_failed",
        "_selected_action": [str(first)],
        "apply": "1",
        "reason": "why not",
        "index": 0,
    }
    client.post(changelist(WorkflowAgentDelivery), posted, follow=True)
    assert delivery(first).status == "failed"
    grant(viewer, "retry_delivery")
    client.post(changelist(WorkflowAgentDelivery), posted, follow=True)
    assert delivery(first).status == "pending"


@pytest.mark.parametrize("action", ["release_leases", "mark_failed"])
def test_actions_skip_the_rows_of_a_quiescing_community(admin_client, action):
    healthy, quiescing = factories.Step(), factories.Step()
    ids = [*committed(healthy), *committed(quiescing)]
    claim(healthy, healthy.targets[0])
    claim(quiescing, quiescing.targets[0])
    services.begin_deletion(quiescing.community.id)

    reported = run_action(admin_client, WorkflowAgentDelivery, action, ids)

    assert reported[0].endswith(": 1 done, 1 skipped (1 community not active).")
    assert delivery(ids[0]).status != DeliveryStatus.CLAIMED
    assert delivery(ids[1]).status == DeliveryStatus.CLAIMED


def test_reap_action_reclaims_expired_leases_and_skips_fenced_communities(admin_client, raw):
    healthy, quiescing = factories.Step(), factories.Step()
    ids = [*committed(healthy), *committed(quiescing)]
    for step, delivery_id in zip((healthy, quiescing), ids, strict=True):
        claim(step, step.targets[0])
        expire(raw, delivery_id)
    services.begin_deletion(quiescing.community.id)

    reported = run_action(admin_client, WorkflowAgentDelivery, "reap_expired_leases", ids[:1])

    assert reported == ["Reap expired leases: 1 done, 1 skipped (1 in communities not active)."]
    assert (delivery(ids[0]).status, delivery(ids[0]).lease_generation) == ("pending", 2)
    assert delivery(ids[1]).status == DeliveryStatus.CLAIMED
    assert LogEntry.objects.filter(change_message__startswith="Reaped 1 expired").exists()


def test_community_lifecycle_moves_only_through_the_fence_executor(admin_client):
    community = factories.community()
    generation = community.deletion_fence_generation

    def move(action: str) -> tuple[str, str, int]:
        (reported,) = run_action(admin_client, Community, action, [community.id])
        community.refresh_from_db()
        return reported, community.deletion_state, community.deletion_fence_generation

    assert move("fence_communities") == (
        "Fence: 0 done, 1 skipped (1 not quiescing).",
        "active",
        generation,
    )
    assert move("begin_deletion") == (
        "Begin deletion: 1 done, 0 skipped.",
        "quiescing",
        generation + 1,
    )
    assert move("cancel_deletion") == (
        "Cancel deletion: 1 done, 0 skipped.",
        "active",
        generation + 2,
    )
    move("begin_deletion")
    assert move("fence_communities") == ("Fence: 1 done, 0 skipped.", "fenced", generation + 4)
    assert move("cancel_deletion") == (
        "Cancel deletion: 0 done, 1 skipped (1 not quiescing).",
        "fenced",
        generation + 4,
    )
    assert move("tombstone") == ("Tombstone: 1 done, 0 skipped.", "tombstone", generation + 5)
    assert LogEntry.objects.filter(object_id=str(community.id)).count() == 5


def populate(communities: int, targets: int, raw) -> None:
    """Rows in several communities and every status, some leases expired."""
    for _ in range(communities):
        step = factories.Step(targets=targets)
        first, *_ = committed(step)
        claim(step, step.targets[0])
        expire(raw, first)
        if targets > 1:
            services.finish_delivery(claim(step, step.targets[1]), Outcome.FAILED)


def test_the_list_page_query_count_does_not_grow_with_rows(admin_client, raw):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(changelist(WorkflowAgentDelivery))
        assert response.status_code == 200
        return len(captured), response.context["cl"].result_count

    populate(5, 1, raw)
    few, shown = queries()
    assert shown == 5
    populate(9, 5, raw)
    many, shown = queries()
    assert shown == 50
    assert many == few


def test_search_finds_a_delivery_by_its_keys(admin_client, step):
    ids = committed(step)
    other = factories.Step()
    committed(other)
    message = bytes(step.message.id).hex()

    assert listed(admin_client, step.targets[1].hex()) == [ids[1]]
    assert listed(admin_client, step.targets[1].hex().upper()) == [ids[1]]
    assert listed(admin_client, str(ids[2])) == [ids[2]]
    assert sorted(listed(admin_client, str(step.run.id))) == sorted(ids)
    assert sorted(listed(admin_client, message)) == sorted(ids)
    assert listed(admin_client, f"{message} {step.targets[0].hex()}") == [ids[0]]
    assert listed(admin_client, factories.key32().hex()) == []
    assert len(listed(admin_client, "step-")) == 4


def test_filters_by_status_and_expired_lease(admin_client, step, raw):
    expired, live, pending = committed(step)
    claim(step, step.targets[0])
    claim(step, step.targets[1])
    expire(raw, expired)

    assert sorted(listed(admin_client, status__exact="claimed")) == sorted([expired, live])
    assert listed(admin_client, status__exact="pending") == [pending]
    assert listed(admin_client, lease="expired") == [expired]
    page = admin_client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert page.count("(expired)") == 1
