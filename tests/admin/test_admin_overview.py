"""The admin for the operator's question: the overview (numbers checked against the
database), a delivery's timeline and attempts, the expired filter, prefix search, the
reap button that needs no selection, and skipped rows that say why."""

from __future__ import annotations

import re

import pytest
from django.db.models import Count
from django.urls import reverse

from tests.support import factories
from tests.support.admin_pages import (
    change,
    changelist,
    claim,
    committed,
    expire,
    grant,
    listed,
    run_action,
)
from workflow_delivery import services
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery

pytestmark = pytest.mark.django_db

OVERVIEW = "/admin/workflow_delivery/workflowagentdelivery/overview/"
REAP = "/admin/workflow_delivery/workflowagentdelivery/reap/"


def cell(page: str, host: str, attribute: str) -> str:
    row = re.search(rf'<tr data-community="{re.escape(host)}">(.*?)</tr>', page, re.S)
    assert row is not None, host
    value = re.search(rf'<td class="num" {attribute}>(.*?)</td>', row.group(1), re.S)
    assert value is not None, attribute
    return value.group(1).strip()


def test_overview_numbers_are_the_databases(admin_client, raw):
    busy, quiet = factories.Step(targets=4), factories.Step(targets=2)
    ids = committed(busy)
    committed(quiet)
    services.finish_delivery(claim(busy, busy.targets[0]), "finished")
    services.finish_delivery(claim(busy, busy.targets[1]), "failed")
    claim(busy, busy.targets[2])
    expire(raw, ids[2])
    claim(quiet, quiet.targets[0])
    services.begin_deletion(quiet.community.id)

    page = admin_client.get(OVERVIEW).content.decode()
    for step in (busy, quiet):
        rows = WorkflowAgentDelivery.objects.filter(community=step.community)
        expected = dict(rows.values_list("status").annotate(n=Count("id")))
        for status in ("pending", "claimed", "finished", "failed"):
            shown = cell(page, step.community.host, f'data-status="{status}"')
            assert int(shown) == expected.get(status, 0)
    assert cell(page, busy.community.host, 'data-figure="expired"') == "1"
    assert cell(page, quiet.community.host, 'data-figure="expired"') == "— (skipped)"
    assert "quiescing (the reaper and pruning skip it)" in page
    settled = WorkflowAgentDelivery.objects.filter(status__in=["finished", "failed"]).count()
    assert f"Settles per minute, last hour ({settled} in all)" in page
    svg = page[page.index('<svg class="wd-settles"') :]
    svg = svg[: svg.index("</svg>")]
    assert svg.count("<rect") == 60
    assert "0 min ago: 2 settled" in svg
    assert "<script" not in page.split('id="content-main"')[1]


def test_a_deliverys_page_shows_its_timeline_attempts_and_a_quiescing_community(
    admin_client, admin_user, raw
):
    step = factories.Step(targets=1)
    (delivery_id,) = committed(step)
    claim(step, step.targets[0])
    expire(raw, delivery_id)
    services.reap_deliveries()
    claim(step, step.targets[0])
    page = admin_client.get(change(WorkflowAgentDelivery, delivery_id)).content.decode()
    table = page[page.index('class="wd-timeline"') :]
    for kind, actor in [("committed", "producer"), ("claimed", "holder"), ("reaped", "reaper")]:
        assert re.search(rf"<td>{kind}</td>.*?<td>{actor}</td>", table, re.S)
    assert table.count("<td>claimed</td>") == 2
    attempts = re.search(r"Attempts:</label>\s*<div class=\"readonly\">(\d+)</div>", page)
    assert attempts is not None and attempts.group(1) == "2"
    services.begin_deletion(step.community.id)
    page = admin_client.get(change(WorkflowAgentDelivery, delivery_id)).content.decode()
    assert "community quiescing: the reaper skips this lease" in page


def test_the_expired_filter_lists_only_leases_the_reaper_will_take(admin_client, raw):
    healthy, quiet = factories.Step(), factories.Step()
    (healthy_id,) = committed(healthy)
    (quiet_id,) = committed(quiet)
    for step, delivery_id in ((healthy, healthy_id), (quiet, quiet_id)):
        claim(step, step.targets[0])
        expire(raw, delivery_id)
    services.begin_deletion(quiet.community.id)
    assert listed(admin_client, lease="expired") == [healthy_id]


def test_the_12_hex_prefix_the_list_shows_finds_the_targets_deliveries(admin_client):
    step = factories.Step(targets=2)
    ids = committed(step)
    prefix = step.targets[0].hex()[:12]
    page = admin_client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert f"{prefix}…" in page
    assert listed(admin_client, prefix) == [ids[0]]
    assert listed(admin_client, f"{prefix}…") == [ids[0]]
    assert listed(admin_client, prefix.upper()) == [ids[0]]
    assert listed(admin_client, step.targets[0].hex()) == [ids[0]]
    assert listed(admin_client, prefix[:11]) == []  # not whole bytes: no key match


def test_reap_now_needs_no_selection_and_its_own_permission(client, viewer, raw):
    step = factories.Step()
    (delivery_id,) = committed(step)
    claim(step, step.targets[0])
    expire(raw, delivery_id)
    page = client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert "Reap expired leases now" not in page
    assert client.post(REAP).status_code == 403
    grant(viewer, "reap_deliveries")
    page = client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert "Reap expired leases now" in page
    assert client.get(REAP).status_code == 405
    response = client.post(REAP, follow=True)
    messages = [str(m) for m in response.context["messages"]]
    assert messages == ["Reap expired leases: 1 done, 0 skipped."]
    assert WorkflowAgentDelivery.objects.get(pk=delivery_id).status == "pending"


def test_release_says_why_it_skipped_a_pending_row(admin_client):
    step = factories.Step(targets=2)
    pending, held = committed(step)
    claim(step, step.targets[1])
    reported = run_action(admin_client, WorkflowAgentDelivery, "release_leases", [pending, held])
    assert reported == ["Release lease: 1 done, 1 skipped (1 not claimed)."]
    entry = DeliveryTransition.objects.filter(delivery_id=held).order_by("id").last()
    assert (entry.kind, entry.actor) == ("released", "operator:admin")


def test_overview_is_linked_from_the_list(admin_client):
    page = admin_client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert reverse("admin:workflow_delivery_overview") in page


def test_overview_needs_the_delivery_lists_view_permission(client, django_user_model):
    factories.Step(targets=1)
    staff = django_user_model.objects.create_user("staff-only", is_staff=True)
    client.force_login(staff)
    listing = "/admin/workflow_delivery/workflowagentdelivery/"
    assert client.get(listing).status_code == 403
    response = client.get(OVERVIEW)
    assert response.status_code == 403
    assert b"data-community" not in response.content
    grant(staff, "view_workflowagentdelivery")
    assert client.get(OVERVIEW).status_code == 200
