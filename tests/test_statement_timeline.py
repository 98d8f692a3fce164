"""The timeline's triggers (migration 0017): the usual life (commit, claim, the holder's
settle) never calls the recording function, a departure calls it once for its row and
writes the claim it ends before itself; the reaper's and the operator's statements write
the same entries themselves, one INSERT each (migration 0018); a delivery's key never
changes."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test import override_settings

from tests import factories
from tests.test_attempts_timeline import raw_sql
from workflow_delivery import history, services
from workflow_delivery.exceptions import ConstraintViolation
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome, Reaped

pytestmark = pytest.mark.django_db

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


def entries(step: factories.Step, kind: str) -> list[tuple]:
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
    assert entries(step, "claimed") == [("pending", "claimed", 1, "holder")] * TARGETS
    assert entries(step, "reaped") == [("claimed", "pending", 2, "reaper")] * TARGETS
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
