"""A delivery's attempts, counted by the database (one per claim, whatever a raw write says),
and the cap: the reaper fails a delivery whose last attempt expired, spares live leases and
fenced communities, and its command reports them; without a cap it never fails one."""

from __future__ import annotations

import uuid
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from tests.support import factories
from tests.support.delivery_rows import claim, expire, one_delivery, raw_sql, row, timeline
from workflow_delivery import services
from workflow_delivery.exceptions import ConstraintViolation
from workflow_delivery.protocol import LeaseLost, Reaped, Settled

pytestmark = pytest.mark.django_db


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
    services.begin_deletion(fenced_step.community.id)
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
