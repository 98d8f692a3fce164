"""The admin's "why not delivered?" page for one (community, target): every verdict, the
figures against the database, the permission, the links to it, malformed URLs, and the
one statement it costs and the indexes that statement uses."""

from __future__ import annotations

import html
import re
import uuid

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from tests.support import factories
from tests.support.admin_pages import change, changelist, claim, committed, expire, grant
from workflow_delivery import services
from workflow_delivery.admin import target as admin_target
from workflow_delivery.admin.target import read_target_state, target_url, when
from workflow_delivery.models import IdleWakeTarget, WorkflowAgentDelivery
from workflow_delivery.protocol import Exhausted, Outcome, Retried
from workflow_delivery.store import statements as sql

pytestmark = pytest.mark.django_db

TARGETS = "/admin/workflow_delivery/workflowagentdelivery/target/"


def page(client, step: factories.Step, target: bytes | None = None) -> str:
    response = client.get(target_url(step.community.id, target or step.targets[0]))
    assert response.status_code == 200
    return response.content.decode()


def headline(text: str) -> tuple[str, str]:
    found = re.search(r'<p class="wd-verdict" data-verdict="([a-z]+)">(.*?)</p>', text, re.S)
    assert found is not None
    return found.group(1), html.unescape(found.group(2))


def verdict_kinds(text: str) -> list[str]:
    """The headline's kind, then the others'."""
    return [headline(text)[0], *re.findall(r'<li data-verdict="([a-z]+)">', text)]


def figure(text: str, name: str) -> str:
    found = re.search(rf'data-figure="{name}">(.*?)</td>', text, re.S)
    assert found is not None, name
    return html.unescape(found.group(1)).strip()


def same_target(step: factories.Step, step_id: str) -> factories.Step:
    """Another step of the same community for the same target (a second delivery)."""
    other = factories.Step(owner=step.community, targets=[step.targets[0]], step_id=step_id)
    committed(other)
    return other


def delivery_row(delivery_id: uuid.UUID):
    """The delivery's last claim as its row keeps it (the history shows the same time)."""
    return WorkflowAgentDelivery.objects.get(id=delivery_id)


def test_a_fenced_community_says_nothing_is_claimable(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    services.begin_deletion(step.community.id)
    shown = page(admin_client, step)
    assert headline(shown) == (
        "fenced",
        "Community is quiescing: nothing is claimable (the write fence refuses every claim "
        "and settle, and the reaper skips the community).",
    )
    assert "unclaimed" not in verdict_kinds(shown)
    assert figure(shown, "claimable") == "0"
    services.transition_community(step.community.id, "fenced")
    assert headline(page(admin_client, step))[1].startswith(
        "Community is fenced: nothing is claimable"
    )


def test_deliveries_backing_off_say_until_when(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    same_target(step, "step-2")
    same_target(step, "step-3")
    for delay in (60, 120):
        result = services.retry_delivery(
            claim(step, step.targets[0]), error="busy", delay_seconds=delay
        )
        assert isinstance(result, Retried)
    first = WorkflowAgentDelivery.objects.exclude(available_at=None).order_by("available_at")[0]
    state = read_target_state(step.community.id, step.targets[0])
    assert (state.pending, state.backing_off, state.claimable) == (3, 2, 1)
    assert state.next_available_at == first.available_at

    claim(step, step.targets[0])  # the one not backing off: only the backoff is left
    shown = page(admin_client, step)
    assert headline(shown) == (
        "backoff",
        f"2 deliveries are waiting for their retry backoff until {when(first.available_at)} "
        "(the first of them).",
    )
    assert figure(shown, "backing-off") == "2"
    assert figure(shown, "next-available") == when(first.available_at)


def test_claimable_rows_with_no_claimer_say_since_when(admin_client):
    step = factories.Step(targets=1)
    (first,) = committed(step)
    services.finish_delivery(claim(step, step.targets[0]), Outcome.FINISHED)
    same_target(step, "step-2")
    claimed_at = delivery_row(first).last_claimed_at
    kind, text = headline(page(admin_client, step))
    assert kind == "unclaimed"
    assert text.startswith(
        f"No agent has claimed for this target since {when(claimed_at)}: 1 delivery claimable"
    )


def test_a_target_never_claimed_says_so(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    shown = page(admin_client, step)
    kind, text = headline(shown)
    assert kind == "unclaimed"
    assert text.startswith("No agent has claimed for this target (no claim on record)")
    assert figure(shown, "agent").startswith("no sign of one")
    assert figure(shown, "last-claim") == "none on record"


def test_an_idle_agent_with_claimable_rows_is_told_apart(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    services.register_idle(step.community.id, step.targets)
    registered = IdleWakeTarget.objects.get(community_id=step.community.id).registered_at
    shown = page(admin_client, step)
    kind, text = headline(shown)
    assert kind == "idle"
    assert text.startswith(f"An agent registered idle at {when(registered)}, yet 1 delivery")
    assert "registered idle (waiting for a wake-up)" in figure(shown, "agent")


def test_an_expired_lease_says_the_reaper_has_not_run(admin_client, raw):
    step = factories.Step(targets=1)
    (delivery_id,) = committed(step)
    claim(step, step.targets[0])
    expire(raw, delivery_id)
    until = WorkflowAgentDelivery.objects.get(pk=delivery_id).lease_until
    shown = page(admin_client, step)
    assert headline(shown) == ("expired", f"Lease expired at {when(until)}, reaper has not run.")
    assert (figure(shown, "claimed"), figure(shown, "expired")) == ("1", "1")
    services.reap_deliveries()
    shown = page(admin_client, step)
    assert "expired" not in verdict_kinds(shown)
    assert figure(shown, "expired") == "0"


def test_an_expired_lease_in_a_fenced_community_says_the_reaper_skips_it(admin_client, raw):
    step = factories.Step(targets=1)
    (delivery_id,) = committed(step)
    claim(step, step.targets[0])
    expire(raw, delivery_id)
    services.begin_deletion(step.community.id)
    shown = page(admin_client, step)
    assert verdict_kinds(shown) == ["fenced", "expired"]
    assert "the reaper does not take it while the community is not active" in shown


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=1)
def test_attempts_exhausted_are_counted_with_their_last_error(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    result = services.retry_delivery(claim(step, step.targets[0]), error=KeyError("step_id"))
    assert isinstance(result, Exhausted)
    shown = page(admin_client, step)
    assert verdict_kinds(shown) == ["exhausted", "nothing"]
    assert figure(shown, "exhausted") == "1"
    assert figure(shown, "settled") == "1"
    assert "KeyError: " in figure(shown, "last-error")


def test_a_live_lease_says_an_agent_is_working(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    same_target(step, "step-2")
    lease = claim(step, step.targets[0])
    shown = page(admin_client, step)
    assert headline(shown) == (
        "held",
        f"An agent is working: 1 live lease, until {when(lease.lease_until)}; "
        "1 delivery more claimable.",
    )
    assert figure(shown, "agent").startswith(f"yes: a live lease until {when(lease.lease_until)}")


def test_a_target_with_nothing_waiting_says_so_with_its_last_settle(admin_client):
    step = factories.Step(targets=1)
    (delivery_id,) = committed(step)
    services.finish_delivery(claim(step, step.targets[0]), Outcome.FINISHED)
    settled = WorkflowAgentDelivery.objects.get(pk=delivery_id).finished_at
    shown = page(admin_client, step)
    assert headline(shown) == (
        "nothing",
        f"Nothing is waiting for this target: no pending or claimed delivery; "
        f"last settle at {when(settled)}.",
    )
    assert figure(shown, "last-settle") == when(settled)
    stranger = page(admin_client, step, factories.key32())
    assert headline(stranger) == (
        "nothing",
        "Nothing is waiting for this target: no pending or claimed delivery.",
    )


def test_the_figures_are_the_databases(raw):
    step = factories.Step(targets=2)
    target, other = step.targets
    committed(step)
    for n in range(2, 6):
        same_target(step, f"step-{n}")
    services.finish_delivery(claim(step, target), Outcome.FAILED)
    services.retry_delivery(claim(step, target), error="later", delay_seconds=300)
    expired = claim(step, target)
    expire(raw, expired.delivery_id)
    live = claim(step, target)
    claim(step, other)  # another target's lease is not this one's

    state = read_target_state(step.community.id, target)
    rows = WorkflowAgentDelivery.objects.for_target(step.community.id, target)
    pending = rows.pending()
    assert state.pending == pending.count() == 2
    assert state.backing_off == pending.exclude(available_at=None).count() == 1
    assert state.oldest_pending_at == min(pending.values_list("created_at", flat=True))
    assert state.claimed == rows.claimed().count() == 2
    assert state.expired_leases == rows.expired_leases().count() == 1
    assert state.live_lease_until == live.lease_until
    assert state.settled == rows.terminal().count() == 1
    assert state.last_claimed_at == delivery_row(live.delivery_id).last_claimed_at
    retried = rows.exclude(last_error_at=None).get()
    assert (state.last_error_type, state.last_error_message) == (
        retried.last_error_type,
        retried.last_error_message,
    )
    assert state.idle_since is None


def test_settles_are_searched_in_a_bounded_window_of_the_community(db):
    step = factories.Step(targets=2)
    target, other = step.targets
    committed(step)
    services.finish_delivery(claim(step, target), Outcome.FINISHED)
    services.finish_delivery(claim(step, other), Outcome.FINISHED)
    wide = read_target_state(step.community.id, target)
    narrow = read_target_state(step.community.id, target, window=1)
    assert (wide.window_settles, wide.settled, wide.last_settled_at is not None) == (2, 1, True)
    assert (narrow.window_settles, narrow.settled, narrow.last_settled_at) == (1, 0, None)


def test_hostile_text_in_an_error_and_a_host_is_escaped(admin_client):
    step = factories.Step(targets=1)
    step.community.host = "<script>alert(1)</script>.example"
    step.community.save()
    committed(step)
    services.retry_delivery(
        claim(step, step.targets[0]), error="<img src=x onerror=alert(1)>", delay_seconds=60
    )
    shown = page(admin_client, step)
    assert "<script>alert" not in shown
    assert "<img src=x" not in shown
    assert "&lt;img src=x onerror=alert(1)&gt;" in shown


def test_it_needs_the_delivery_lists_view_permission(client, django_user_model):
    step = factories.Step(targets=1)
    committed(step)
    url = target_url(step.community.id, step.targets[0])
    staff = django_user_model.objects.create_user("staff-only", is_staff=True)
    client.force_login(staff)
    response = client.get(url)
    assert response.status_code == 403
    assert b"data-verdict" not in response.content
    grant(staff, "view_workflowagentdelivery")
    assert client.get(url).status_code == 200


def test_a_deliverys_page_and_the_list_link_to_it(admin_client):
    step = factories.Step(targets=2)
    delivery_id, _ = committed(step)
    committed(factories.Step(targets=[step.targets[0]]))  # the same key in another community
    url = target_url(step.community.id, step.targets[0])
    detail = admin_client.get(change(WorkflowAgentDelivery, delivery_id)).content.decode()
    assert f'<a href="{url}" class="wd-target-link">' in detail
    listing = admin_client.get(changelist(WorkflowAgentDelivery)).content.decode()
    assert f'<a href="{url}">' in listing
    response = admin_client.get(url)
    assert response.status_code == 200
    back = admin_client.get(response.context["deliveries_url"])
    assert back.status_code == 200
    assert [row.pk for row in back.context["cl"].result_list] == [delivery_id]


@pytest.mark.parametrize(
    ("community", "target", "named"),
    [
        ("not-a-uuid", "ab" * 32, b"community id 'not-a-uuid' is not a UUID"),
        ("%00", "ab" * 32, b"community id '\\x00' is not a UUID"),
        (None, "zz" * 32, b"is not a public key (64 hex digits)"),
        (None, "ab" * 31, b"is not a public key (64 hex digits)"),
        (None, "ab" * 33, b"is not a public key (64 hex digits)"),
        (None, "%3Cscript%3E", b"target '<script>' is not a public key"),
        (None, "ab" * 31 + "%00%00", b"is not a public key"),
    ],
)
def test_a_malformed_url_is_a_400_naming_the_part(admin_client, community, target, named):
    step = factories.Step(targets=1)
    url = f"{TARGETS}{community or step.community.id}/{target}/"
    response = admin_client.get(url)
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/plain")
    assert named in response.content


def test_an_unknown_community_is_a_404_and_upper_case_hex_is_accepted(admin_client):
    step = factories.Step(targets=1)
    committed(step)
    assert admin_client.get(target_url(uuid.uuid4(), step.targets[0])).status_code == 404
    upper = target_url(step.community.id, step.targets[0]).replace(
        step.targets[0].hex(), step.targets[0].hex().upper()
    )
    assert admin_client.get(upper).status_code == 200


@override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=False)  # on Django's cursor: counted
def test_the_state_is_one_query_however_many_rows(django_assert_num_queries, raw):
    step = factories.Step(targets=1)
    committed(step)
    with django_assert_num_queries(1):
        read_target_state(step.community.id, step.targets[0])
    for n in range(2, 12):
        same_target(step, f"step-{n}")
    services.finish_delivery(claim(step, step.targets[0]), Outcome.FINISHED)
    services.retry_delivery(claim(step, step.targets[0]), error="x", delay_seconds=60)
    expire(raw, claim(step, step.targets[0]).delivery_id)
    with django_assert_num_queries(1):
        read_target_state(step.community.id, step.targets[0])


def test_the_page_query_count_does_not_grow_with_rows(admin_client):
    step = factories.Step(targets=1)
    committed(step)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            page(admin_client, step)
        return len(captured)

    few = queries()
    for n in range(2, 12):
        same_target(step, f"step-{n}")
        services.finish_delivery(claim(step, step.targets[0]), Outcome.FINISHED)
    assert queries() == few


def test_every_delivery_read_goes_through_an_index(raw):
    """With sequential scans priced out, a part of the statement no index serves would
    still be planned as one: none is."""
    step = factories.Step(targets=1)
    committed(step)
    # Other agents' deliveries in the same community, and statistics that have seen
    # them: each index is priced on this data, not on near-ties that whatever
    # statistics earlier tests left behind could tip either way.
    committed(factories.Step(owner=step.community, targets=300, step_id="others"))
    raw.execute(f"ANALYZE {WorkflowAgentDelivery._meta.db_table}")
    raw.execute("SET LOCAL enable_seqscan = off")
    raw.execute(
        f"EXPLAIN {sql.TARGET_STATE.text}",
        {
            "community": step.community.id,
            "target": step.targets[0],
            "window": admin_target.SETTLE_WINDOW,
            "cap": 20,
        },
    )
    plan = "\n".join(line for (line,) in raw.fetchall())
    assert "Seq Scan" not in plan, plan
    for index in (
        "wd_delivery_claim_idx",
        "wd_delivery_reap_community_idx",
        "wd_delivery_settled_idx",
    ):
        assert index in plan, index
