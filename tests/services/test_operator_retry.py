"""An operator's retry of failed deliveries (what the admin's action and
``retry_deliveries`` call): a failed row goes back to pending with its fence bumped, its
attempts budget renewed and the operator's reason on its timeline; a finished row never
reopens, which PostgreSQL itself refuses, whatever a raw statement says."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.support import factories
from tests.support.delivery_rows import claim, expire, one_delivery, raw_sql, row, timeline
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, ConstraintViolation, ProtocolError
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import Exhausted, LeaseLost, Reaped, Retried, Settled

pytestmark = pytest.mark.django_db


def failed_delivery(error: str | None = "boom"):
    step, delivery_id = one_delivery()
    lease = claim(step)
    assert services.finish_delivery(lease, "failed", error=error) == Settled(outcome="failed")
    return step, delivery_id, lease


def retry(step, ids, reason="upstream fixed", operator="alice"):
    return services.retry_failed_deliveries(
        step.community.id, ids, operator=operator, reason=reason
    )


def test_a_failed_delivery_goes_back_to_pending_and_is_claimed_at_once():
    step, delivery_id, lease = failed_delivery()
    assert retry(step, [delivery_id]) == [delivery_id]
    after = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    assert (after.status, after.finished_at, after.available_at) == ("pending", None, None)
    assert after.lease_generation == lease.generation + 1
    assert (after.attempts, after.attempts_at_retry) == (1, 1)
    assert after.last_error_message == "boom"  # the last attempt's error is kept
    again = claim(step)
    assert again.delivery_id == delivery_id and again.generation == lease.generation + 2
    assert services.finish_delivery(again, "finished") == Settled(outcome="finished")


def test_the_timeline_names_the_operator_and_the_reason():
    step, delivery_id, lease = failed_delivery()
    retry(step, [delivery_id], reason="the mail server is back")
    entry = DeliveryTransition.objects.filter(delivery_id=delivery_id).latest("id")
    assert (entry.kind, entry.status_before, entry.status_after, entry.actor, entry.reason) == (
        "operator_retried",
        "failed",
        "pending",
        "operator:alice",
        "the mail server is back",
    )
    assert entry.generation == lease.generation + 1
    assert [kind for kind, *_ in timeline(delivery_id)] == [
        "committed",
        "claimed",
        "failed",
        "operator_retried",
    ]
    services.finish_delivery(claim(step), "failed", error="again")
    assert [kind for kind, *_ in timeline(delivery_id)][-2:] == ["claimed", "failed"]


def test_the_holder_of_the_failed_attempt_is_fenced_out_after_a_retry():
    step, delivery_id, lease = failed_delivery()
    assert services.finish_delivery(lease, "failed").__class__.__name__ == "AlreadyTerminal"
    retry(step, [delivery_id])
    assert services.finish_delivery(lease, "finished") == LeaseLost()
    assert row(delivery_id)["status"] == "pending"


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=2)
def test_a_retry_renews_the_attempts_budget_for_the_reaper_and_the_holder():
    step, delivery_id = one_delivery()
    for expected in (Reaped(reclaimed=1), Reaped(exhausted=1)):
        claim(step)
        expire(delivery_id)
        assert services.reap_deliveries() == expected
    assert row(delivery_id)["status"] == "failed"
    for _ in range(2):
        retry(step, [delivery_id])
        # Two more claims each time before the cap fails it again.
        assert isinstance(
            services.retry_delivery(claim(step), error="down", delay_seconds=0), Retried
        )
        claim(step)
        expire(delivery_id)
        assert services.reap_deliveries() == Reaped(exhausted=1)
    retry(step, [delivery_id])
    claim(step)
    expire(delivery_id)
    assert services.reap_deliveries() == Reaped(reclaimed=1)
    assert isinstance(
        services.retry_delivery(claim(step), error="down", delay_seconds=0), Exhausted
    )
    assert row(delivery_id)["attempts"] == 8


def test_finished_pending_and_claimed_rows_are_left_as_they_are():
    step = factories.Step(targets=3)
    ids = [d.id for d in factories.committed(step)]
    settled, _ = services.claim_delivery(step.community.id, step.targets[0])
    services.finish_delivery(settled, "finished")
    services.claim_delivery(step.community.id, step.targets[1])
    before = list(WorkflowAgentDelivery.objects.filter(id__in=ids).order_by("id").values())
    assert retry(step, ids) == []
    assert list(WorkflowAgentDelivery.objects.filter(id__in=ids).order_by("id").values()) == before


def test_a_community_not_active_is_skipped():
    step, delivery_id, _ = failed_delivery()
    factories.move_to(step.community.id, "quiescing")
    assert retry(step, [delivery_id]) == []
    assert row(delivery_id)["status"] == "failed"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"reason": ""}, "reason"),
        ({"reason": "   "}, "reason"),
        ({"reason": None}, "reason"),
        ({"reason": "r" * 501}, "reason"),
        ({"reason": "nul\x00"}, "reason"),
        ({"operator": ""}, "operator"),
        ({"operator": None}, "operator"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(options, field):
    step, delivery_id, _ = failed_delivery()
    with pytest.raises(ProtocolError) as caught:
        retry(step, [delivery_id], **{"reason": "ok", "operator": "alice", **options})
    assert caught.value.field == field
    assert row(delivery_id)["status"] == "failed"


# What a retry writes, as a raw statement would write it.
RETRY_SQL = (
    "UPDATE workflow_agent_deliveries SET status = 'pending', finished_at = NULL, "
    "lease_generation = lease_generation + 1, attempts_at_retry = attempts WHERE id = %s"
)


def test_postgresql_never_reopens_a_finished_delivery():
    step, delivery_id = one_delivery()
    services.finish_delivery(claim(step), "finished")
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(RETRY_SQL, [delivery_id])
    assert refused.value.constraint == "wd_delivery_terminal_once"
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET status = 'failed', "
            "lease_generation = lease_generation + 1 WHERE id = %s",
            [delivery_id],
        )
    assert refused.value.constraint == "wd_delivery_terminal_once"
    assert row(delivery_id)["status"] == "finished"


def test_postgresql_lets_a_failed_delivery_back_by_the_rules_of_a_retry():
    _, delivery_id, _ = failed_delivery()
    raw_sql(RETRY_SQL, [delivery_id])
    assert row(delivery_id)["status"] == "pending"


@pytest.mark.parametrize(
    "assignments",
    [
        # The fence not bumped: the failed attempt's holder would hold it again.
        "status = 'pending', finished_at = NULL, attempts_at_retry = attempts",
        # The budget not renewed.
        "status = 'pending', finished_at = NULL, lease_generation = lease_generation + 1",
        # The recorded error rewritten on the way.
        "status = 'pending', finished_at = NULL, lease_generation = lease_generation + 1, "
        "attempts_at_retry = attempts, last_error_message = 'rewritten'",
    ],
)
def test_postgresql_refuses_a_way_back_that_breaks_the_rules_of_a_retry(assignments):
    _, delivery_id, _ = failed_delivery()
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(f"UPDATE workflow_agent_deliveries SET {assignments} WHERE id = %s", [delivery_id])
    assert refused.value.constraint == "wd_delivery_retry_renews"
    assert row(delivery_id)["status"] == "failed"


def test_attempts_at_retry_changes_only_with_a_retry_and_never_past_attempts():
    step, delivery_id = one_delivery()
    claim(step)
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET attempts_at_retry = 1 WHERE id = %s",
            [delivery_id],
        )
    assert refused.value.constraint == "wd_delivery_retry_renews"
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(
            "UPDATE workflow_agent_deliveries SET attempts_at_retry = 5 WHERE id = %s",
            [delivery_id],
        )
    assert refused.value.constraint == "wd_delivery_attempts_at_retry_range"


@pytest.mark.parametrize(
    ("kind", "reason", "constraint"),
    [
        ("operator_retried", None, "wd_timeline_reason_of_retry"),
        ("operator_retried", "  ", "wd_timeline_reason_of_retry"),
        ("released", "why not", "wd_timeline_reason_of_retry"),
        ("operator_retried", "r" * 501, "wd_timeline_reason_length"),
    ],
)
def test_only_an_operator_retry_entry_carries_a_reason(kind, reason, constraint):
    step, delivery_id, _ = failed_delivery()
    with pytest.raises(ConstraintViolation) as refused:
        raw_sql(
            "INSERT INTO workflow_delivery_timeline (community_id, delivery_id, at, kind, "
            "generation, attempts, status_before, status_after, actor, reason) "
            "VALUES (%s, %s, now(), %s, 1, 1, 'failed', 'pending', 'sql', %s)",
            [step.community.id, delivery_id, kind, reason],
        )
    assert refused.value.constraint == constraint


def test_a_fenced_community_refuses_a_raw_retry():
    step, delivery_id, _ = failed_delivery()
    services.begin_deletion(step.community.id)
    with pytest.raises(CommunityWriteFenced):
        raw_sql(RETRY_SQL, [delivery_id])
    assert row(delivery_id)["status"] == "failed"
