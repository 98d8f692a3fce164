"""services.finish_and_claim_next: a holder's settle and its next claim in one statement.

The settle keeps every rule of finish_delivery (generation, target, expiry, terminal
once, the fence, the timeline) and the claim every rule of claim_delivery (oldest first,
skip locked, backoff, the fence); a settle that does not happen claims nothing. Raced by
many holders at once, no delivery is held twice and each settles exactly once."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import Counter

import pytest
from django.db import connection, transaction

from tests.support import factories
from tests.support.delivery_rows import entries, expire, row, stored, timeline
from tests.support.races import (
    GIVE_UP_SECONDS,
    Session,
    begin,
    commit,
    limit_lock_waits,
    run_together,
    scalar,
)
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, ProtocolError
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    FinishedAndNext,
    Lease,
    LeaseLost,
    Outcome,
    Settled,
)

pytestmark = pytest.mark.django_db


def backlog(count: int, targets: int = 1) -> tuple[factories.Step, list[uuid.UUID]]:
    """``count`` steps of one run to the same targets, committed oldest first; the ids
    of the first target's deliveries in commit order."""
    step = factories.Step(targets=targets)
    for n in range(count):
        factories.committed(step)
        step.step_id = f"step-{n + 2}"
    # In one transaction the rows share created_at: the claim's order is then by id.
    ids = WorkflowAgentDelivery.objects.filter(
        community_id=step.community.id, target_pubkey=step.targets[0]
    ).order_by("created_at", "id")
    return step, list(ids.values_list("id", flat=True))


def claim(step: factories.Step, target: bytes | None = None) -> Lease:
    target = step.targets[0] if target is None else target
    lease, _ = services.claim_delivery(step.community.id, target, lease_seconds=60)
    return lease


def untouched(delivery_id: uuid.UUID) -> bool:
    stored_row = row(delivery_id)
    return (stored_row["status"], stored_row["lease_generation"]) == ("pending", 0)


def test_a_settle_claims_the_targets_oldest_pending_delivery_with_it():
    step, (first, second, third) = backlog(3)
    lease = claim(step)
    assert lease.delivery_id == first

    answer = services.finish_and_claim_next(lease, Outcome.FINISHED, lease_seconds=30)

    assert answer.result == Settled(outcome=Outcome.FINISHED)
    assert row(first)["status"] == "finished"
    next_lease, record = answer.next
    assert record.id == next_lease.delivery_id == second
    assert (record.status, record.lease_generation, record.attempts) == ("claimed", 1, 1)
    assert next_lease.generation == 1 and next_lease.target_pubkey == step.targets[0]
    assert row(second)["status"] == "claimed" and row(second)["lease_until"] == record.lease_until
    with transaction.atomic():
        window = scalar(
            "SELECT extract(epoch FROM lease_until - claimed_at) FROM workflow_agent_deliveries "
            "WHERE id = %s",
            [second],
        )
    assert window == 30
    assert untouched(third)
    # The next lease is a lease like any other: it settles and claims in turn.
    last = services.finish_and_claim_next(next_lease, Outcome.FAILED)
    assert last.result == Settled(outcome=Outcome.FAILED) and last.next[1].id == third
    assert services.finish_and_claim_next(last.next[0], "finished") == FinishedAndNext(
        result=Settled(outcome=Outcome.FINISHED), next=None
    )
    assert [row(i)["status"] for i in (first, second, third)] == ["finished", "failed", "finished"]


def test_another_target_of_the_community_may_be_claimed_next_never_another_communitys():
    step = factories.Step(targets=2)
    factories.committed(step)
    stranger = factories.Step(targets=[step.targets[1]])
    (foreign,) = factories.committed(stranger)
    lease = claim(step)
    answer = services.finish_and_claim_next(lease, Outcome.FINISHED, target_pubkey=step.targets[1])
    next_lease, record = answer.next
    assert record.binding.target_pubkey == next_lease.target_pubkey == step.targets[1]
    assert record.binding.community_id == next_lease.community_id == step.community.id
    assert untouched(foreign.id)


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda lease: Lease(**{**_fields(lease), "generation": 7}), id="generation"),
        pytest.param(
            lambda lease: Lease(**{**_fields(lease), "target_pubkey": factories.key32()}),
            id="target",
        ),
        pytest.param(
            lambda lease: Lease(**{**_fields(lease), "community_id": uuid.uuid4()}),
            id="community",
        ),
        pytest.param(lambda lease: (expire(lease.delivery_id), lease)[1], id="expired"),
    ],
)
def test_a_lost_lease_settles_nothing_and_claims_nothing(spoil):
    step, (held, waiting) = backlog(2)
    lease = spoil(claim(step))
    answer = services.finish_and_claim_next(lease, Outcome.FINISHED)
    assert answer == FinishedAndNext(result=LeaseLost(), next=None)
    assert row(held)["status"] == "claimed"
    assert untouched(waiting)


def _fields(lease: Lease) -> dict:
    return dataclasses.asdict(lease)


def test_a_retry_of_a_settle_reports_the_recorded_status_and_claims_nothing():
    step, (held, waiting) = backlog(2)
    lease = claim(step)
    assert services.finish_delivery(lease, Outcome.FAILED) == Settled(outcome=Outcome.FAILED)
    answer = services.finish_and_claim_next(lease, Outcome.FINISHED)
    assert answer == FinishedAndNext(result=AlreadyTerminal(status=DeliveryStatus.FAILED))
    assert row(held)["status"] == "failed"
    assert untouched(waiting)


def test_a_stale_holder_after_a_reap_and_a_newer_settle_gets_lease_lost():
    step, (held, waiting) = backlog(2)
    stale = claim(step)
    expire(held)
    services.reap_deliveries()
    newer = claim(step)
    assert newer.delivery_id == held and newer.generation == stale.generation + 2
    assert services.finish_and_claim_next(newer, Outcome.FINISHED).next[1].id == waiting
    assert services.finish_and_claim_next(stale, Outcome.FAILED).result == LeaseLost()
    assert row(held)["status"] == "finished"


def test_a_fenced_community_refuses_the_settle_and_the_claim_alike():
    step, (held, waiting) = backlog(2)
    lease = claim(step)
    factories.move_to(step.community.id, "fenced")
    with pytest.raises(CommunityWriteFenced), transaction.atomic():
        services.finish_and_claim_next(lease, Outcome.FINISHED)
    assert row(held)["status"] == "claimed"
    assert untouched(waiting)


def test_a_revoked_agent_settles_nothing_and_claims_nothing():
    step, (held, waiting) = backlog(2)
    lease = claim(step)
    services.revoke_agent(step.community.id, step.targets[0])
    assert services.finish_and_claim_next(lease, Outcome.FINISHED).result == LeaseLost()
    # The revocation gave the lease back; the agent's pending deliveries stay as they were.
    assert row(held)["status"] == "pending" and row(held)["lease_generation"] == 2
    assert untouched(waiting)


def test_a_delivery_backing_off_is_passed_over_for_the_next_one():
    step, (first, second, third) = backlog(3)
    lease = claim(step)
    services.retry_delivery(lease, error="busy", delay_seconds=60)
    held = claim(step)
    assert held.delivery_id == second
    answer = services.finish_and_claim_next(held, Outcome.FINISHED)
    assert answer.next[1].id == third
    # Only the backed-off delivery is left: nothing is claimable.
    assert services.finish_and_claim_next(answer.next[0], Outcome.FINISHED).next is None
    assert row(first)["status"] == "pending"


def test_a_failure_with_its_error_is_kept_and_the_timeline_shows_both_deliveries():
    step, (first, second) = backlog(2)
    lease = claim(step)
    try:
        raise KeyError("payload")
    except KeyError as exc:
        answer = services.finish_and_claim_next(lease, Outcome.FAILED, error=exc)
    assert answer.result == Settled(outcome=Outcome.FAILED) and answer.next[1].id == second
    failed = WorkflowAgentDelivery.objects.get(pk=first)
    assert (failed.status, failed.last_error_type) == ("failed", "KeyError")
    assert timeline(first) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
        ("failed", "claimed", "failed", 1, "holder"),
    ]
    assert stored(first) == ["claimed", "failed"]
    (entry,) = [e for e in entries(first) if e.kind == "failed"]
    assert "KeyError: 'payload'" in entry.error_traceback
    # The next delivery's claim is the usual life: implied by its row, nothing stored.
    assert timeline(second) == [
        ("committed", None, "pending", 0, "producer"),
        ("claimed", "pending", "claimed", 1, "holder"),
    ]
    assert stored(second) == []
    services.finish_and_claim_next(answer.next[0], Outcome.FINISHED)
    assert timeline(second)[-1] == ("finished", "claimed", "finished", 1, "holder")
    assert stored(second) == []


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"lease": "lease", "outcome": "finished"}, "lease"),
        ({"outcome": "done"}, "outcome"),
        ({"outcome": "finished", "error": "boom"}, "error"),
        ({"outcome": "finished", "target_pubkey": b"short"}, "target_pubkey"),
        ({"outcome": "finished", "lease_seconds": 0}, "lease_seconds"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(arguments, field):
    step, (held, waiting) = backlog(2)
    arguments = {"lease": claim(step), **arguments}
    with pytest.raises(ProtocolError) as raised:
        services.finish_and_claim_next(**arguments)
    assert raised.value.field == field
    assert row(held)["status"] == "claimed" and untouched(waiting)


# --- on committed rows, other sessions at once ------------------------------------------


@pytest.fixture
def lock_timeout(transactional_db):
    limit_lock_waits()
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


def test_a_row_another_session_holds_is_skipped_not_waited_for(lock_timeout):
    step, (held, locked, free) = backlog(3)
    lease = claim(step)
    other = Session()
    try:
        other.call(begin)
        other.call(
            scalar,
            "SELECT id FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE",
            [locked],
        )
        # Autocommit: the settle and the claim commit together, on the lane.
        answer = services.finish_and_claim_next(lease, Outcome.FINISHED)
        assert answer.next[1].id == free
        assert row(held)["status"] == "finished"
    finally:
        other.call(commit)
        other.close()
    assert untouched(locked)


WORKERS = 6
DELIVERIES = 120


@pytest.mark.django_db(transaction=True)
def test_many_holders_settling_and_claiming_never_share_a_delivery_and_settle_each_once():
    step, ids = backlog(DELIVERIES)
    settled: Counter[uuid.UUID] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + GIVE_UP_SECONDS

    def holder(index: int) -> list[tuple[uuid.UUID, int]]:
        held: list[tuple[uuid.UUID, int]] = []
        claimed = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
        while claimed is not None and time.monotonic() < deadline:
            lease, record = claimed
            assert record.status == "claimed" and record.lease_generation == lease.generation
            held.append((lease.delivery_id, lease.generation))
            outcome = Outcome.FINISHED if index % 2 else Outcome.FAILED
            answer = services.finish_and_claim_next(lease, outcome, lease_seconds=60)
            assert answer.result == Settled(outcome=outcome)
            with lock:
                settled[lease.delivery_id] += 1
            claimed = answer.next
        return held

    per_holder = run_together(WORKERS, holder)
    holds = [hold for held in per_holder for hold in held]
    assert sorted(delivery for delivery, _ in holds) == sorted(ids), "a delivery held twice"
    assert set(settled.values()) == {1} and set(settled) == set(ids)
    assert {generation for _, generation in holds} == {1}
    statuses = WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True)
    assert set(statuses) <= {"finished", "failed"} and len(statuses) == DELIVERIES
