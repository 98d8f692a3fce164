"""Each delivery's history: the timeline rows the database writes for every departure
from the usual life (raw UPDATEs too, fenced and cascaded), merged with the commit, claim
and settle the row implies. The usual life (commit, claim, the holder's settle) never calls
the recording function, a departure calls it once for its row, a pending commit stores no
entry and one under a named actor stores one; a delivery's key never changes."""

from __future__ import annotations

import re
import uuid

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.urls import reverse

from tests.support import factories
from tests.support.delivery_rows import (
    COPY_DELIVERIES,
    claim,
    entries,
    expire,
    one_delivery,
    raw_sql,
    row,
    run_raw,
    run_with_a_reap,
    stored,
    timeline,
)
from workflow_delivery import history, services
from workflow_delivery.exceptions import (
    CommunityWriteFenced,
    ConstraintViolation,
)
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome, Reaped

pytestmark = pytest.mark.django_db


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
    services.begin_deletion(step.community.id)
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
    services.begin_deletion(step.community.id)
    generation = services.transition_community(step.community.id, "fenced")
    deleted = services.purge_community(step.community.id, generation)
    assert deleted["workflow_delivery_timeline"] == 1
    assert not DeliveryTransition.objects.filter(community_id=step.community.id).exists()
    assert not WorkflowAgentDelivery.objects.filter(community_id=step.community.id).exists()


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


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("reset", ["RESET ALL", "DISCARD ALL", "RESET workflow_delivery.timeline"])
def test_a_session_reset_does_not_turn_the_timeline_back_on(settings, reset):
    """Off, the app tells each session so once; a statement that puts the session's
    settings back to their defaults is noticed, and the session is told again."""
    settings.WORKFLOW_DELIVERY_TIMELINE = False
    step, delivery_id = one_delivery()
    services.reap_deliveries()  # a statement of the app's: the session is told
    with connection.cursor() as cursor:
        cursor.execute(reset)
        cursor.execute("SELECT current_setting('workflow_delivery.timeline', true)")
        assert cursor.fetchone()[0] in {None, ""}
    run_with_a_reap(step, delivery_id)
    assert stored(delivery_id) == []


TARGETS = 40


def calls_during(action) -> dict[str, int]:
    """PostgreSQL's count of calls of the rules' functions while ``action`` runs, in
    the test's transaction."""
    names = ["wd_record_delivery_departure", "wd_enforce_community_write_fence"]
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL track_functions = 'pl'")
        cursor.execute(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE funcname = ANY(%s)",
            [names],
        )
        before = dict(cursor.fetchall())
        action()
        cursor.execute(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE funcname = ANY(%s)",
            [names],
        )
        after = dict(cursor.fetchall())
    return {name: after.get(name, 0) - before.get(name, 0) for name in names}


def kind_entries(step: factories.Step, kind: str) -> list[tuple]:
    rows = DeliveryTransition.objects.filter(community_id=step.community.id, kind=kind)
    return list(rows.values_list("status_before", "status_after", "generation", "actor"))


def claimed_step() -> factories.Step:
    step = factories.Step(targets=TARGETS)
    factories.committed(step)
    for target in step.targets:
        assert services.claim_delivery(step.community.id, target) is not None
    return step


def test_a_reaper_batch_records_every_lease_it_takes_with_its_claim_in_its_statement():
    step = claimed_step()
    WorkflowAgentDelivery.objects.filter(community_id=step.community.id).update(
        lease_until="2000-01-01T00:00:00Z"
    )
    reaped = []
    calls = calls_during(lambda: reaped.append(services.reap_expired_deliveries(batch_size=500)))
    assert reaped == [TARGETS]
    # The row's fence check only: the entries come from the reaper's own statement.
    assert calls == {
        "wd_record_delivery_departure": 0,
        "wd_enforce_community_write_fence": TARGETS,
    }
    assert kind_entries(step, "claimed") == [("pending", "claimed", 1, "holder")] * TARGETS
    assert kind_entries(step, "reaped") == [("claimed", "pending", 2, "reaper")] * TARGETS
    for delivery in WorkflowAgentDelivery.objects.filter(community_id=step.community.id):
        claim = DeliveryTransition.objects.get(delivery_id=delivery.id, kind="claimed")
        assert claim.at == delivery.last_claimed_at
        kinds = DeliveryTransition.objects.filter(delivery_id=delivery.id).order_by("id")
        assert list(kinds.values_list("kind", flat=True)) == ["claimed", "reaped"]


def expire_all(step: factories.Step) -> None:
    WorkflowAgentDelivery.objects.filter(community_id=step.community.id, status="claimed").update(
        lease_until="2000-01-01T00:00:00Z"
    )


def three_leases_to_reap(steps: list[factories.Step]) -> list[list]:
    """Per step, claimed and expired: a holder's first claim (implied by the row), a
    claim under a named actor (stored), and a second claim after an earlier reap (the
    last one a cap of 2 allows). Each step's deliveries, in target order."""
    ids = []
    for step in steps:
        first, named, again = (delivery.id for delivery in factories.committed(step))
        assert services.claim_delivery(step.community.id, step.targets[0]) is not None
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:dan', true)")
            cursor.execute(
                "UPDATE workflow_agent_deliveries SET status = 'claimed', claimed_at = now(), "
                "lease_until = now() + interval '1 minute', lease_generation = 1 WHERE id = %s",
                [named],
            )
            cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
        assert services.claim_delivery(step.community.id, step.targets[2]) is not None
        WorkflowAgentDelivery.objects.filter(id=again).update(lease_until="2000-01-01T00:00:00Z")
        ids.append([first, named, again])
    assert services.reap_deliveries() == Reaped(reclaimed=len(steps))
    for step in steps:
        assert services.claim_delivery(step.community.id, step.targets[2]) is not None
        expire_all(step)
    return ids


def shown(delivery_id) -> list[tuple]:
    delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    return [
        (e.kind, e.status_before, e.status_after, e.generation, e.attempts, e.actor, e.stored)
        for e in history.delivery_history(delivery)
    ]


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=2)
def test_a_batch_reaps_history_is_what_the_trigger_records_for_the_same_change():
    by_reaper, by_trigger = factories.Step(targets=3), factories.Step(targets=3)
    reaped_ids, raw_ids = three_leases_to_reap([by_reaper, by_trigger])
    # The same change by a site's own UPDATE under the reaper's name: the row trigger's.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'reaper', true)")
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET "
            "status = CASE WHEN attempts >= 2 THEN 'failed' ELSE 'pending' END, "
            "lease_generation = lease_generation + 1, lease_until = NULL, claimed_at = NULL, "
            "finished_at = CASE WHEN attempts >= 2 THEN statement_timestamp() END "
            "WHERE community_id = %s AND status = 'claimed'",
            [by_trigger.community.id],
        )
        assert cursor.rowcount == 3
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    assert services.reap_deliveries(batch_size=500) == Reaped(reclaimed=2, exhausted=1)
    histories = [shown(delivery_id) for delivery_id in reaped_ids]
    assert histories == [shown(delivery_id) for delivery_id in raw_ids]
    committed = ("committed", None, "pending", 0, 0, "producer", False)
    assert histories == [
        [
            committed,
            ("claimed", "pending", "claimed", 1, 1, "holder", True),
            ("reaped", "claimed", "pending", 2, 1, "reaper", True),
        ],
        [
            committed,
            ("claimed", "pending", "claimed", 1, 1, "operator:dan", True),
            ("reaped", "claimed", "pending", 2, 1, "reaper", True),
        ],
        [
            committed,
            ("claimed", "pending", "claimed", 1, 1, "holder", True),
            ("reaped", "claimed", "pending", 2, 1, "reaper", True),
            ("claimed", "pending", "claimed", 3, 2, "holder", True),
            ("attempts_exhausted", "claimed", "failed", 4, 2, "reaper", True),
        ],
    ]
    for delivery_id in reaped_ids:
        delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
        times = [e.at for e in history.delivery_history(delivery)]
        assert times == sorted(times)
    # A claim the row implied is written at the time the row kept for it.
    for delivery_id in reaped_ids[0], reaped_ids[2]:
        delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
        claims = DeliveryTransition.objects.filter(delivery_id=delivery_id, kind="claimed")
        assert claims.order_by("id").last().at == delivery.last_claimed_at


def test_the_reapers_setting_ends_with_its_statement_inside_a_transaction():
    step = claimed_step()
    expire_all(step)
    released = WorkflowAgentDelivery.objects.filter(community_id=step.community.id).first()
    with transaction.atomic():
        assert services.reap_deliveries(batch_size=TARGETS - 1).reclaimed == TARGETS
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('workflow_delivery.recorded_by_statement')")
            assert cursor.fetchone()[0] != "on"
        # A later departure in the same transaction is the trigger's to record.
        assert services.claim_delivery(step.community.id, released.target_pubkey) is not None
        assert services.release_deliveries(step.community.id, [released.id]) == [released.id]
    kinds = DeliveryTransition.objects.filter(delivery_id=released.id).order_by("id")
    assert list(kinds.values_list("kind", flat=True)) == [
        "claimed", "reaped", "claimed", "released",
    ]  # fmt: skip


def operator_batch(step: factories.Step) -> list:
    """A pending delivery, one claimed by its holder (the claim implied) and one
    claimed under a named actor (the claim stored). The deliveries, in target order."""
    pending, held, named = (delivery.id for delivery in factories.committed(step))
    assert services.claim_delivery(step.community.id, step.targets[1]) is not None
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:dan', true)")
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET status = 'claimed', claimed_at = now(), "
            "lease_until = now() + interval '1 minute', lease_generation = 1 WHERE id = %s",
            [named],
        )
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    return [pending, held, named]


@pytest.mark.parametrize("action", ["release", "fail"])
def test_an_operator_batch_records_in_its_statement_what_the_trigger_would(action):
    by_service, by_trigger = factories.Step(targets=3), factories.Step(targets=3)
    service_ids, raw_ids = operator_batch(by_service), operator_batch(by_trigger)
    act = services.release_deliveries if action == "release" else services.fail_deliveries
    done = []
    calls = calls_during(
        lambda: done.extend(act(by_service.community.id, service_ids, operator="alice"))
    )
    moved = service_ids[1:] if action == "release" else service_ids
    assert sorted(done) == sorted(moved)
    assert calls["wd_record_delivery_departure"] == 0
    # The same change by a site's own UPDATE under the operator's name: the trigger's.
    write = (
        "status = 'pending', lease_generation = lease_generation + 1, lease_until = NULL, "
        "claimed_at = NULL WHERE status = 'claimed'"
        if action == "release"
        else "status = 'failed', lease_generation = lease_generation + 1, "
        "finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL, "
        "available_at = NULL WHERE status IN ('pending', 'claimed')"
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:alice', true)")
        cursor.execute(
            f"UPDATE workflow_agent_deliveries SET {write} AND community_id = %s",
            [by_trigger.community.id],
        )
        assert cursor.rowcount == len(moved)
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    histories = [shown(delivery_id) for delivery_id in service_ids]
    assert histories == [shown(delivery_id) for delivery_id in raw_ids]
    kind, status = ("released", "pending") if action == "release" else ("operator_failed", "failed")
    assert [history[-1][:3] for history in histories[1:]] == [(kind, "claimed", status)] * 2
    assert [entry[0] for entry in histories[1]] == ["committed", "claimed", kind]
    assert [entry[0] for entry in histories[2]] == ["committed", "claimed", kind]
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('workflow_delivery.recorded_by_statement', true)")
        assert cursor.fetchone()[0] != "on"


def test_the_usual_life_never_calls_the_recording_function():
    step = factories.Step(targets=1)
    commits = calls_during(lambda: [factories.committed(step)])
    claims = []
    calls = calls_during(
        lambda: claims.extend(
            services.claim_deliveries(step.community.id, step.targets[0], limit=5)
        )
    )
    assert len(claims) == 1
    settles = calls_during(
        lambda: services.finish_deliveries([(lease, Outcome.FINISHED) for lease, _ in claims])
    )
    assert [c["wd_record_delivery_departure"] for c in (commits, calls, settles)] == [0, 0, 0]
    assert DeliveryTransition.objects.filter(community_id=step.community.id).count() == 0


def test_a_batch_claim_and_finish_show_each_delivery_once():
    step = factories.Step(targets=1)
    for n in range(5):
        factories.committed(step)
        step.step_id = f"step-{n + 2}"
    claims = services.claim_deliveries(step.community.id, step.targets[0], limit=5)
    assert len(claims) == 5
    services.finish_deliveries([(lease, Outcome.FAILED) for lease, _ in claims])
    for delivery in WorkflowAgentDelivery.objects.filter(community_id=step.community.id):
        shown = [
            (e.kind, e.status_before, e.status_after, e.generation, e.actor)
            for e in history.delivery_history(delivery)
        ]
        assert shown == [
            ("committed", None, "pending", 0, "producer"),
            ("claimed", "pending", "claimed", 1, "holder"),
            ("failed", "claimed", "failed", 1, "holder"),
        ]


def test_a_statement_changing_no_status_records_nothing():
    step = claimed_step()
    before = DeliveryTransition.objects.count()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = lease_until + interval '1 second' "
            "WHERE community_id = %s",
            [step.community.id],
        )
        assert cursor.rowcount == TARGETS
    assert DeliveryTransition.objects.count() == before


def test_a_deliverys_id_cannot_change():
    with override_settings(WORKFLOW_DELIVERY_TIMELINE=False):
        # No timeline entry refers to it, so no foreign key reports the change first.
        step = factories.Step()
        (delivery,) = factories.committed(step)
    with pytest.raises(ConstraintViolation) as caught:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET id = gen_random_uuid() WHERE id = %s",
            [delivery.id],
        )
    assert caught.value.constraint == "wd_delivery_key_immutable"
    assert services.get_delivery(step.community.id, delivery.id) is not None


def test_a_statement_into_active_communities_stores_no_committed_entry():
    first, second = factories.Step(targets=3), factories.Step(targets=4)
    factories.committed(first)
    factories.committed(second)
    assert run_raw(COPY_DELIVERIES, [[str(first.community.id), str(second.community.id)]]) == 7
    copies = WorkflowAgentDelivery.objects.filter(step_id__endswith="-copy")
    assert copies.count() == 7
    assert not DeliveryTransition.objects.filter(delivery__in=copies).exists()
    for copy in copies:
        (entry,) = history.delivery_history(copy)
        # A raw statement names no actor: the producer is assumed.
        assert (entry.kind, entry.status_after, entry.generation, entry.actor, entry.at) == (
            "committed", "pending", 0, "producer", copy.created_at,
        )  # fmt: skip


def test_a_committed_entry_names_the_actor_the_session_set():
    step = factories.Step(targets=2)
    factories.committed(step)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:ada', true)")
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
    copies = WorkflowAgentDelivery.objects.filter(step_id__endswith="-copy")
    assert set(
        DeliveryTransition.objects.filter(delivery__in=copies).values_list("actor", flat=True)
    ) == {"operator:ada"}


def test_a_committed_entry_under_a_named_actor_is_stored_first():
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('workflow_delivery.actor', 'operator:ada', true)")
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
        # Transaction-local, and the test's transaction goes on.
        cursor.execute("SELECT set_config('workflow_delivery.actor', '', true)")
    copy = WorkflowAgentDelivery.objects.get(step_id__endswith="-copy")
    services.finish_delivery(
        services.claim_delivery(step.community.id, step.targets[0], delivery_id=copy.id)[0],
        "finished",
    )
    copy.refresh_from_db()
    shown = [(e.kind, e.actor, e.stored) for e in history.delivery_history(copy)]
    assert shown == [
        ("committed", "operator:ada", True),
        ("claimed", "holder", False),
        ("finished", "holder", False),
    ]


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
