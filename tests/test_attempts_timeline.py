"""Attempts and the cap (kept by the database), and each delivery's history: the
timeline rows the database writes for every departure from the usual life (raw
UPDATEs too, fenced and cascaded), merged with the commit, claim and settle the row
implies."""

from __future__ import annotations

import re
import uuid
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.urls import reverse

from tests import factories
from workflow_delivery import fence, history, services, sql
from workflow_delivery.exceptions import CommunityWriteFenced, ConstraintViolation
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import LeaseLost, Reaped, Settled

pytestmark = pytest.mark.django_db


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
    with transaction.atomic(), sql.database_errors(), connection.cursor() as cursor:
        cursor.execute(statement, params)


# --- attempts ---------------------------------------------------------------------------


def test_each_claim_counts_one_attempt_and_other_writes_count_none():
    step, delivery_id = one_delivery()
    assert row(delivery_id)["attempts"] == 0
    lease = claim(step)
    assert row(delivery_id)["attempts"] == 1
    services.renew_delivery(lease, lease_seconds=30)
    expire(delivery_id)
    assert services.reap_deliveries() == Reaped(reclaimed=1)
    assert row(delivery_id)["attempts"] == 1
    lease = claim(step)
    assert services.finish_delivery(lease, "finished") == Settled(outcome="finished")
    assert row(delivery_id)["attempts"] == 2


def test_a_raw_claim_counts_an_attempt_whatever_it_writes_to_attempts():
    _, delivery_id = one_delivery()
    raw_sql(
        "UPDATE workflow_agent_deliveries SET status = 'claimed', attempts = 7, "
        "lease_generation = lease_generation + 1, claimed_at = now(), "
        "lease_until = now() + interval '1 minute' WHERE id = %s",
        [delivery_id],
    )
    assert row(delivery_id)["attempts"] == 1


@pytest.mark.parametrize("value", [0, 5])
def test_attempts_cannot_change_outside_a_claim(value):
    step, delivery_id = one_delivery()
    claim(step)
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET attempts = %s WHERE id = %s", [value, delivery_id]
        )
    assert caught.value.constraint == "wd_delivery_attempts_count_claims"
    assert row(delivery_id)["attempts"] == 1


def test_attempts_cannot_be_negative():
    _, delivery_id = one_delivery()
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql("UPDATE workflow_agent_deliveries SET attempts = -1 WHERE id = %s", [delivery_id])
    assert caught.value.constraint == "wd_delivery_attempts_nonneg"


def test_a_new_delivery_starts_with_no_attempts():
    _, delivery_id = one_delivery()
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql(
            "INSERT INTO workflow_agent_deliveries (id, community_id, workflow_id, run_id, "
            "step_id, target_pubkey, definition_event_id, message_event_id, "
            "message_event_created_at, cause_kind, cause_event_id, attempts) "
            "SELECT %s, community_id, workflow_id, run_id, 'other', target_pubkey, "
            "definition_event_id, message_event_id, message_event_created_at, cause_kind, "
            "cause_event_id, 3 FROM workflow_agent_deliveries WHERE id = %s",
            [uuid.uuid4(), delivery_id],
        )
    assert caught.value.constraint == "wd_delivery_attempts_count_claims"


# --- the cap ------------------------------------------------------------------------------


def claim_and_expire(step: factories.Step, delivery_id: uuid.UUID) -> None:
    claim(step)
    expire(delivery_id)


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=3)
def test_the_reaper_fails_a_delivery_whose_last_attempt_expired():
    step, delivery_id = one_delivery()
    for _ in range(2):  # reclaimed max - 1 times: back to pending each time
        claim_and_expire(step, delivery_id)
        assert services.reap_deliveries() == Reaped(reclaimed=1, exhausted=0)
        assert row(delivery_id)["status"] == "pending"
    lease = claim(step)
    expire(delivery_id)
    assert services.reap_deliveries() == Reaped(reclaimed=0, exhausted=1)
    settled = row(delivery_id)
    assert settled["status"] == "failed"
    assert settled["finished_at"] is not None and settled["lease_until"] is None
    assert settled["lease_generation"] == lease.generation + 1
    # The holder of the last attempt is fenced out, and the failure is terminal.
    assert services.finish_delivery(lease, "finished") == LeaseLost()
    assert services.claim_delivery(step.community.id, step.targets[0]) is None
    assert timeline(delivery_id)[-1][:3] == ("attempts_exhausted", "claimed", "failed")


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=None)
def test_without_a_cap_the_reaper_never_fails_a_delivery():
    step, delivery_id = one_delivery()
    for _ in range(25):
        claim_and_expire(step, delivery_id)
        assert services.reap_deliveries() == Reaped(reclaimed=1)
    assert row(delivery_id) | {"attempts": 25, "status": "pending"} == row(delivery_id)


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=1)
def test_the_cap_spares_live_leases_and_fenced_communities():
    live_step, live_id = one_delivery()
    claim(live_step)
    fenced_step, fenced_id = one_delivery()
    claim_and_expire(fenced_step, fenced_id)
    fence.begin_deletion(fenced_step.community.id)
    assert services.reap_deliveries() == Reaped()
    assert row(live_id)["status"] == row(fenced_id)["status"] == "claimed"


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=1)
def test_the_reaper_command_reports_the_failed_by_the_cap():
    step, delivery_id = one_delivery()
    claim_and_expire(step, delivery_id)
    out = StringIO()
    call_command("reap_deliveries", stdout=out)
    assert "settled failed 1 expired leases of deliveries that had used every attempt" in (
        out.getvalue()
    )
    assert "reclaimed 0 expired leases" in out.getvalue()


# --- the timeline ---------------------------------------------------------------------------


def test_each_transition_is_one_row_with_its_generation_and_actor(admin_user):
    step, delivery_id = one_delivery()
    lease = claim(step)
    services.renew_delivery(lease, lease_seconds=30)  # a heartbeat: not recorded
    expire(delivery_id)
    services.reap_deliveries()
    lease = claim(step)
    services.release_deliveries(step.community.id, [delivery_id], operator="alice")
    claim(step)
    services.fail_deliveries(step.community.id, [delivery_id], operator="alice")
    final = row(delivery_id)["lease_generation"]  # an operator terminal may bump it (§8)
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
        ("reaped", "claimed", "pending", 2, "reaper"),
        ("claimed", "pending", "claimed", 3, "holder"),
        ("released", "claimed", "pending", 4, "operator:alice"),
        ("claimed", "pending", "claimed", 5, "holder"),
        ("operator_failed", "claimed", "failed", final, "operator:alice"),
    ]
    assert [e.attempts for e in entries(delivery_id)] == [0, 1, 1, 2, 2, 3, 3]
    # The commit is the row's; every claim was written by the departure that ended it.
    assert stored(delivery_id) == [kind for kind, *_ in timeline(delivery_id)][1:]
    times = [e.at for e in entries(delivery_id)]
    assert times == sorted(times)


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_a_holders_settle_is_implied_by_the_row_and_stores_nothing(outcome):
    step, delivery_id = one_delivery()
    lease = claim(step)
    claimed_at = WorkflowAgentDelivery.objects.get(pk=delivery_id).claimed_at
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
    ]
    services.finish_delivery(lease, outcome)
    delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
        (outcome, "claimed", outcome, 1, "holder"),
    ]
    # Each step at the row's own time; no row written for any of them.
    assert [e.at for e in entries(delivery_id)] == [
        delivery.created_at,
        claimed_at,
        delivery.finished_at,
    ]
    assert delivery.claimed_at is None and delivery.last_claimed_at == claimed_at
    assert [e.stored for e in entries(delivery_id)] == [False, False, False]
    assert stored(delivery_id) == []


def test_a_second_claim_after_a_reap_shows_both_claims_in_order():
    step, delivery_id = one_delivery()
    claim(step)
    first = WorkflowAgentDelivery.objects.get(pk=delivery_id).claimed_at
    expire(delivery_id)
    services.reap_deliveries()
    services.finish_delivery(claim(step), "finished")
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
        ("reaped", "claimed", "pending", 2, "reaper"),
        ("claimed", "pending", "claimed", 3, "holder"),
        ("finished", "claimed", "finished", 3, "holder"),
    ]
    assert entries(delivery_id)[1].at == first
    assert stored(delivery_id) == ["claimed", "reaped"]


def test_a_holders_release_records_the_claim_it_gives_back():
    step, delivery_id = one_delivery()
    services.release_lease(claim(step))
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
        ("released", "claimed", "pending", 2, "sql"),
    ]
    assert stored(delivery_id) == ["claimed", "released"]


def test_an_operator_fail_of_a_pending_delivery_follows_its_commit():
    step, delivery_id = one_delivery()
    services.fail_deliveries(step.community.id, [delivery_id], operator="carol")
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("operator_failed", "pending", "failed", 1, "operator:carol"),
    ]
    assert stored(delivery_id) == ["operator_failed"]


def test_a_claim_under_a_named_actor_is_stored_once():
    _, delivery_id = one_delivery()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:dan', true)")
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET status = 'claimed', claimed_at = now(), "
            "lease_until = now() + interval '1 minute', lease_generation = 1 WHERE id = %s",
            [delivery_id],
        )
        # Transaction-local, and the test's transaction goes on.
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    expire(delivery_id)
    services.reap_deliveries()
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "operator:dan"),
        ("reaped", "claimed", "pending", 2, "reaper"),
    ]


def test_last_claimed_at_is_kept_by_the_database():
    step, delivery_id = one_delivery()
    claim(step)
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET last_claimed_at = now() - interval '1 hour' "
            "WHERE id = %s",
            [delivery_id],
        )
    assert caught.value.constraint == "wd_delivery_last_claimed_at_by_claims"
    # A raw claim gets it from its claimed_at, whatever it writes there itself.
    expire(delivery_id)
    services.reap_deliveries()
    raw_sql(
        "UPDATE workflow_agent_deliveries SET status = 'claimed', claimed_at = now(), "
        "lease_until = now() + interval '1 minute', lease_generation = lease_generation + 1, "
        "last_claimed_at = NULL WHERE id = %s",
        [delivery_id],
    )
    delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    assert delivery.last_claimed_at == delivery.claimed_at


def test_raw_updates_are_recorded_and_name_their_actor_when_set():
    step, delivery_id = one_delivery()
    claim(step)
    raw_sql(
        "UPDATE workflow_agent_deliveries SET status = 'pending', lease_until = NULL, "
        "claimed_at = NULL, lease_generation = lease_generation + 1 WHERE id = %s",
        [delivery_id],
    )
    claim(step)
    expire(delivery_id)
    raw_sql(
        "UPDATE workflow_agent_deliveries SET status = 'pending', lease_until = NULL, "
        "claimed_at = NULL, lease_generation = lease_generation + 1 WHERE id = %s",
        [delivery_id],
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:bob', true)")
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET status = 'failed', finished_at = now() "
            "WHERE id = %s",
            [delivery_id],
        )
    assert timeline(delivery_id)[2:] == [
        ("released", "claimed", "pending", 2, "sql"),
        ("claimed", "pending", "claimed", 3, "holder"),
        ("reaped", "claimed", "pending", 4, "sql"),
        ("operator_failed", "pending", "failed", 4, "operator:bob"),
    ]


def test_the_actor_setting_ends_with_the_services_block():
    step, delivery_id = one_delivery()
    claim(step)
    services.release_deliveries(step.community.id, [delivery_id])
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('workflow_delivery.actor', true)")
        assert cursor.fetchone()[0] in ("", None)
    services.finish_delivery(claim(step), "finished")
    assert [entry[4] for entry in timeline(delivery_id)][-2:] == ["holder", "holder"]


def test_the_timeline_of_a_non_active_community_cannot_be_written():
    step, delivery_id = one_delivery()
    services.fail_deliveries(step.community.id, [delivery_id], operator="erin")
    fence.begin_deletion(step.community.id)
    with pytest.raises(CommunityWriteFenced):
        raw_sql(
            "INSERT INTO workflow_delivery_timeline (community_id, delivery_id, at, kind, "
            "generation, attempts, status_after, actor) "
            "VALUES (%s, %s, now(), 'claimed', 1, 1, 'claimed', 'sql')",
            [step.community.id, delivery_id],
        )
    with pytest.raises(CommunityWriteFenced):
        raw_sql("DELETE FROM workflow_delivery_timeline WHERE delivery_id = %s", [delivery_id])
    assert stored(delivery_id) == ["operator_failed"]


def test_the_timeline_cannot_point_at_another_communitys_delivery():
    _, delivery_id = one_delivery()
    other = factories.community()
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql(
            "INSERT INTO workflow_delivery_timeline (community_id, delivery_id, at, kind, "
            "generation, attempts, status_after, actor) "
            "VALUES (%s, %s, now(), 'claimed', 1, 1, 'claimed', 'sql')",
            [other.id, delivery_id],
        )
    assert caught.value.constraint == "wd_timeline_delivery_fk"


def test_the_timeline_goes_with_its_delivery():
    step, delivery_id = one_delivery()
    services.release_lease(claim(step))
    services.finish_delivery(claim(step), "finished")
    assert len(stored(delivery_id)) == 2
    step.run.delete()
    assert not DeliveryTransition.objects.filter(delivery_id=delivery_id).exists()


def test_the_executor_purges_the_timeline_of_a_fenced_community():
    step, delivery_id = one_delivery()
    services.fail_deliveries(step.community.id, [delivery_id], operator="erin")
    fence.begin_deletion(step.community.id)
    generation = fence.transition_community(step.community.id, "fenced")
    deleted = fence.purge_community(step.community.id, generation)
    assert deleted["workflow_delivery_timeline"] == 1
    assert not DeliveryTransition.objects.filter(community_id=step.community.id).exists()
    assert not WorkflowAgentDelivery.objects.filter(community_id=step.community.id).exists()


def run_with_a_reap(step: factories.Step, delivery_id: uuid.UUID) -> None:
    claim(step)
    expire(delivery_id)
    services.reap_deliveries()
    services.finish_delivery(claim(step), "finished")


def test_the_timeline_can_be_turned_off_for_the_apps_sessions(settings):
    """Off, no row is written: the history is what the row itself says (its commit,
    last claim and settle), and the claims it cannot show are counted."""
    settings.WORKFLOW_DELIVERY_TIMELINE = False
    step, delivery_id = one_delivery()
    run_with_a_reap(step, delivery_id)
    assert stored(delivery_id) == []
    assert timeline(delivery_id) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 3, "holder"),
        ("finished", "claimed", "finished", 3, "holder"),
    ]
    delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    assert history.unrecorded_attempts(entries(delivery_id), delivery) == 1
    settings.WORKFLOW_DELIVERY_TIMELINE = True
    other, other_id = one_delivery()
    run_with_a_reap(other, other_id)
    assert stored(other_id) == ["claimed", "reaped"]
    assert [entry[0] for entry in timeline(other_id)] == [
        "committed", "claimed", "reaped", "claimed", "finished",
    ]  # fmt: skip
    delivery = WorkflowAgentDelivery.objects.get(pk=other_id)
    assert history.unrecorded_attempts(entries(other_id), delivery) == 0


def shown_kinds(admin_client, delivery_id: uuid.UUID) -> tuple[list[str], str]:
    """The kinds in the delivery page's timeline table, in order, and the page."""
    url = reverse("admin:workflow_delivery_workflowagentdelivery_change", args=[delivery_id])
    page = admin_client.get(url).content.decode()
    table = page[page.index('class="wd-timeline"') :]
    table = table[: table.index("</table>")]
    return re.findall(r"<tr><td>[^<]*</td><td>(\w+)</td>", table), page


def test_the_admin_shows_a_finished_deliverys_whole_history(admin_client):
    step, delivery_id = one_delivery()
    services.finish_delivery(claim(step), "finished")
    kinds, page = shown_kinds(admin_client, delivery_id)
    assert kinds == ["committed", "claimed", "finished"]
    assert "wd-timeline-gap" not in page


def test_the_admin_says_how_many_attempts_the_timeline_missed(admin_client, settings):
    settings.WORKFLOW_DELIVERY_TIMELINE = False
    step, delivery_id = one_delivery()
    run_with_a_reap(step, delivery_id)
    settings.WORKFLOW_DELIVERY_TIMELINE = True
    kinds, page = shown_kinds(admin_client, delivery_id)
    assert kinds == ["committed", "claimed", "finished"]
    assert "1 earlier attempt(s) not recorded" in page
