"""The timeline's triggers (migration 0017): the usual life (commit, claim, the holder's
settle) never calls the recording function, a departure calls it once for its row and
writes the claim it ends before itself; a delivery's key never changes."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import override_settings

from tests import factories
from tests.test_attempts_timeline import raw_sql
from workflow_delivery import history, services
from workflow_delivery.exceptions import ConstraintViolation
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome

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


def test_a_reaper_batch_records_every_lease_it_takes_with_its_claim():
    step = claimed_step()
    WorkflowAgentDelivery.objects.filter(community_id=step.community.id).update(
        lease_until="2000-01-01T00:00:00Z"
    )
    reaped = []
    calls = calls_during(lambda: reaped.append(services.reap_expired_deliveries(batch_size=500)))
    assert reaped == [TARGETS]
    assert calls == {
        "wd_record_delivery_departure": TARGETS,
        "wd_enforce_community_write_fence": TARGETS,
    }
    assert entries(step, "claimed") == [("pending", "claimed", 1, "holder")] * TARGETS
    assert entries(step, "reaped") == [("claimed", "pending", 2, "reaper")] * TARGETS
    for delivery in WorkflowAgentDelivery.objects.filter(community_id=step.community.id):
        claim = DeliveryTransition.objects.get(delivery_id=delivery.id, kind="claimed")
        assert claim.at == delivery.last_claimed_at


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
