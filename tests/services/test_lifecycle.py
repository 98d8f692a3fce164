"""The operations of SPEC §5 and invariants 1 to 9 of SPEC §7, on a real PostgreSQL server.

These tests run inside one transaction, so ``now()`` is one instant throughout: a lease
"expires" by moving its ``lease_until`` before that instant with a raw UPDATE.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, transaction
from django.test import override_settings

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.conf import app_settings
from workflow_delivery.exceptions import (
    BindingScopeError,
    CommunityWriteFenced,
    DeliveryConflict,
    InvalidLeaseSeconds,
    ProtocolError,
    ReferenceMissing,
)
from workflow_delivery.models import Event, Workflow, WorkflowAgentDelivery, WorkflowRun
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryBinding,
    DeliveryStatus,
    EventCause,
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    Renewed,
    ScheduleCause,
    Settled,
    WebhookCause,
)

LEASE_STATE = ["status", "lease_generation", "lease_until", "claimed_at", "finished_at"]
NOT_ACTIVE = ["quiescing", "fenced", "tombstone"]

pytestmark = pytest.mark.django_db


def state(delivery_id: uuid.UUID) -> dict:
    return WorkflowAgentDelivery.objects.values(*LEASE_STATE).get(pk=delivery_id)


def seconds(count: int) -> timedelta:
    return timedelta(seconds=count)


def every_row() -> list[dict]:
    return list(WorkflowAgentDelivery.objects.order_by("id").values())


def db_now(raw) -> datetime:
    """The database clock of this statement (lease times are statement times)."""
    raw.execute("SELECT statement_timestamp()")
    return raw.fetchone()[0]


def timed(raw, call, *args, **kwargs):
    """``call``'s result and the database clock just before and just after it."""
    before = db_now(raw)
    result = call(*args, **kwargs)
    return result, before, db_now(raw)


def expire(raw, *delivery_ids: uuid.UUID) -> None:
    """Let these leases run out: their end moves one second before the database's now()."""
    raw.execute(
        "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 second' "
        "WHERE id = ANY(%s)",
        [list(delivery_ids)],
    )


def claim(step: factories.Step, target: bytes | None = None, **kwargs) -> tuple | None:
    target = step.targets[0] if target is None else target
    return services.claim_delivery(step.community.id, target, **kwargs)


def held(step: factories.Step, target: bytes | None = None, **kwargs) -> Lease:
    claimed = claim(step, target, **kwargs)
    assert claimed is not None
    return claimed[0]


# --- identity lock + commit ------------------------------------------------------------


def test_first_commit_of_a_step_creates_every_target_and_returns_their_ids(step):
    deliveries = step.new_deliveries()
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
        assert identity.exists is False
        created = identity.commit(step.created_at, deliveries)
        assert identity.exists is True
    assert sorted(created) == sorted(item.id for item in deliveries)
    stored = {row["id"]: row for row in every_row()}
    assert set(stored) == set(created)
    for item in deliveries:
        record = services.get_delivery(step.community.id, item.id)
        assert record.binding == item.binding
        assert (record.status, record.lease_generation) == (DeliveryStatus.PENDING, 0)
        assert record.message_event_created_at == step.created_at


def test_identity_reports_an_existing_step_but_not_its_siblings(step):
    factories.committed(step)
    other_run = factories.run(step.workflow)
    scopes = {
        (step.run.id, step.step_id): True,
        (step.run.id, "step-2"): False,
        (other_run.id, step.step_id): False,
    }
    for (run_id, step_id), exists in scopes.items():
        with services.delivery_identity(str(step.community.id), str(run_id), step_id) as identity:
            assert identity.exists is exists, (run_id, step_id)


def test_producer_retry_with_new_ids_creates_nothing_and_leaves_the_original_untouched(step):
    """Invariant 1."""
    originals = factories.committed(step)
    held(step)
    before = every_row()
    retry = [NewDelivery(uuid.uuid4(), item.binding) for item in originals]
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
        assert identity.exists is True
        assert identity.commit(step.created_at, retry) == []
    assert services.commit_deliveries(step.community.id, step.created_at, retry) == []
    assert every_row() == before


def test_retry_that_adds_a_target_creates_only_the_new_one(step):
    first, second, third = step.new_deliveries()
    services.commit_deliveries(step.community.id, step.created_at, [first, second])
    retry = [NewDelivery(uuid.uuid4(), item.binding) for item in (first, second)] + [third]
    assert services.commit_deliveries(step.community.id, step.created_at, retry) == [third.id]
    assert {row["id"] for row in every_row()} == {first.id, second.id, third.id}


def test_producer_writes_roll_back_with_the_step(step):
    with (
        pytest.raises(RuntimeError),
        services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity,
    ):
        signed = factories.message(step.community, step.targets)
        bindings = [step.binding(t, message_event_id=bytes(signed.id)) for t in step.targets]
        created = identity.commit(
            signed.created_at, [NewDelivery(uuid.uuid4(), b) for b in bindings]
        )
        assert len(created) == len(step.targets)
        raise RuntimeError("the producer fails after committing its deliveries")
    assert not Event.objects.filter(pk=signed.id).exists()
    assert every_row() == []


def test_commit_of_another_communitys_bindings_is_refused_and_writes_nothing(step):
    foreign = factories.Step(targets=2)
    with pytest.raises(BindingScopeError) as caught:
        services.commit_deliveries(step.community.id, foreign.created_at, foreign.new_deliveries())
    assert caught.value.field == "community_id"
    assert str(step.community.id) in str(caught.value)
    assert every_row() == []


def test_commit_mixing_in_one_foreign_binding_writes_nothing(step):
    foreign = factories.community()
    mine, theirs = step.new_deliveries()[:2]
    smuggled = NewDelivery(
        uuid.uuid4(), dataclasses.replace(theirs.binding, community_id=foreign.id)
    )
    with pytest.raises(BindingScopeError) as caught:
        services.commit_deliveries(step.community.id, step.created_at, [mine, smuggled])
    assert caught.value.field == "community_id"
    assert every_row() == []


@pytest.mark.parametrize("other", ["step_id", "run_id"])
def test_commit_of_several_steps_is_a_clear_error(step, other):
    first, second = step.new_deliveries()[:2]
    elsewhere = {"step_id": "step-2", "run_id": factories.run(step.workflow).id}[other]
    moved = NewDelivery(second.id, dataclasses.replace(second.binding, **{other: elsewhere}))
    with pytest.raises(BindingScopeError, match="several steps") as caught:
        services.commit_deliveries(step.community.id, step.created_at, [first, moved])
    assert caught.value.field == "step_id"
    assert every_row() == []


def test_commit_failing_for_one_target_writes_no_target(step):
    """Invariant 9: one bad reference rolls back every row of the step."""
    *good, last = step.new_deliveries()
    orphan = NewDelivery(last.id, dataclasses.replace(last.binding, workflow_id=uuid.uuid4()))
    with pytest.raises(ReferenceMissing) as caught:
        services.commit_deliveries(step.community.id, step.created_at, [*good, orphan])
    assert caught.value.constraint == "wd_delivery_run_fk"
    assert every_row() == []


def test_commit_reusing_a_delivery_id_of_another_step_writes_no_target(step):
    (taken,) = factories.committed(factories.Step(step.community))
    first, second, third = step.new_deliveries()
    reused = NewDelivery(taken.id, second.binding)
    with pytest.raises(DeliveryConflict):
        services.commit_deliveries(step.community.id, step.created_at, [first, reused, third])
    assert {row["id"] for row in every_row()} == {taken.id}


def test_failed_commit_rolls_back_the_producers_own_writes(step):
    with (
        pytest.raises(ReferenceMissing),
        services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity,
    ):
        signed = factories.message(step.community, step.targets)
        # The deliveries name a message instant that does not exist: a bad reference.
        later = signed.created_at + timedelta(seconds=1)
        bindings = [step.binding(t, message_event_id=bytes(signed.id)) for t in step.targets]
        identity.commit(later, [NewDelivery(uuid.uuid4(), b) for b in bindings])
    assert not Event.objects.filter(pk=signed.id).exists()
    assert every_row() == []


# --- claim -------------------------------------------------------------------------------


def test_claim_returns_a_lease_and_the_full_record(step, raw):
    first = factories.committed(step)[0]
    (lease, record), before, after = timed(
        raw,
        services.claim_delivery,
        str(step.community.id),
        first.binding.target_pubkey,
        lease_seconds=90,
    )
    assert record.id == first.id
    assert record.binding == first.binding
    assert record.status == DeliveryStatus.CLAIMED
    assert (record.lease_generation, record.finished_at) == (1, None)
    assert before <= record.claimed_at <= after
    assert record.lease_until == record.claimed_at + timedelta(seconds=90)
    assert lease == Lease(step.community.id, first.id, step.targets[0], 1, record.lease_until)
    assert services.get_delivery(step.community.id, first.id) == record


def test_claim_takes_the_oldest_pending_delivery_by_created_at_then_id(raw):
    owner, target = factories.community(), factories.key32()
    steps = [factories.Step(owner, targets=[target]) for _ in range(4)]
    ids = sorted(factories.committed(s)[0].id for s in steps)
    ages = {ids[3]: 30, ids[0]: 20, ids[2]: 10, ids[1]: 10}
    for delivery_id, seconds in ages.items():
        raw.execute(
            "UPDATE workflow_agent_deliveries SET created_at = now() - make_interval(secs => %s) "
            "WHERE id = %s",
            [seconds, delivery_id],
        )
    order = [held(steps[0], target).delivery_id for _ in ids]
    assert order == [ids[3], ids[0], ids[1], ids[2]]
    assert claim(steps[0], target) is None


def test_claim_by_delivery_id_takes_only_that_row(raw):
    owner, target = factories.community(), factories.key32()
    older, newer = (factories.Step(owner, targets=[target]) for _ in range(2))
    (old,), (new,) = factories.committed(older), factories.committed(newer)
    raw.execute(
        "UPDATE workflow_agent_deliveries SET created_at = now() - interval '1 minute' "
        "WHERE id = %s",
        [old.id],
    )
    assert held(older, target, delivery_id=new.id).delivery_id == new.id
    assert claim(older, target, delivery_id=new.id) is None
    assert claim(older, target, delivery_id=uuid.uuid4()) is None
    assert state(old.id)["status"] == "pending"
    assert held(older, target, delivery_id=str(old.id)).delivery_id == old.id


def test_claims_are_isolated_by_community_and_target():
    """Invariant 2, with the same target key in two communities."""
    target = factories.key32()
    mine, theirs = factories.Step(targets=[target]), factories.Step(targets=[target])
    (my_delivery,), (their_delivery,) = factories.committed(mine), factories.committed(theirs)
    assert claim(mine, factories.key32()) is None
    assert claim(mine, target, delivery_id=their_delivery.id) is None
    assert held(mine, target).delivery_id == my_delivery.id
    assert claim(mine, target) is None
    assert state(their_delivery.id)["status"] == "pending"
    assert held(theirs, target).delivery_id == their_delivery.id


MISMATCHES: dict[str, Callable[[DeliveryBinding], dict]] = {
    "step": lambda b: {"step_id": b.step_id + "-other"},
    "workflow": lambda b: {"workflow_id": uuid.uuid4()},
    "run": lambda b: {"run_id": uuid.uuid4()},
    "definition": lambda b: {"definition_event_id": factories.key32()},
    "message": lambda b: {"message_event_id": factories.key32()},
    "cause kind (schedule)": lambda b: {"cause": ScheduleCause(factories.whole_second_now())},
    "cause kind (webhook)": lambda b: {"cause": WebhookCause(uuid.uuid4())},
    "cause identity": lambda b: {"cause": EventCause(factories.key32())},
    "community": lambda b: {"community_id": factories.community().id},
    "target": lambda b: {"target_pubkey": factories.key32()},
}


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_expected_binding_differing_in_one_field_is_a_miss_that_changes_nothing(field):
    """Invariant 3. A pending decoy for the same target proves a miss is no path to another row."""
    step = factories.Step(targets=1)
    (wanted,) = factories.committed(step)
    factories.committed(factories.Step(step.community, targets=step.targets, step_id="decoy"))
    expected = dataclasses.replace(wanted.binding, **MISMATCHES[field](wanted.binding))
    before = every_row()
    assert claim(step, expected=expected) is None
    assert claim(step, delivery_id=wanted.id, expected=expected) is None
    assert every_row() == before
    assert held(step, expected=wanted.binding).delivery_id == wanted.id


@pytest.mark.parametrize(
    ("stored", "other"),
    [
        (ScheduleCause(datetime(2030, 1, 1, 9, tzinfo=UTC)), timedelta(seconds=1)),
        (WebhookCause(uuid.uuid4()), uuid.uuid4()),
    ],
    ids=["schedule", "webhook"],
)
def test_expected_cause_must_match_in_identity(stored, other):
    step = factories.Step(targets=1)
    step.cause = stored
    (wanted,) = factories.committed(step)
    if isinstance(stored, ScheduleCause):
        different = ScheduleCause(stored.scheduled_for + other)
    else:
        different = WebhookCause(other)
    before = every_row()
    assert claim(step, expected=dataclasses.replace(wanted.binding, cause=different)) is None
    assert every_row() == before
    assert held(step, expected=wanted.binding).delivery_id == wanted.id


# --- lease seconds -----------------------------------------------------------------------

ABOVE_MAXIMUM = "above the maximum"
BAD_LEASE_SECONDS = pytest.mark.parametrize(
    "value",
    [0, -1, 1.5, True, "60", ABOVE_MAXIMUM],
    ids=["0", "-1", "1.5", "True", "'60'", "max+1"],
)


def bad_lease_seconds(value: object) -> object:
    return app_settings.MAX_LEASE_SECONDS + 1 if value is ABOVE_MAXIMUM else value


@BAD_LEASE_SECONDS
def test_claim_refuses_bad_lease_seconds_and_claims_nothing(step, value):
    factories.committed(step)
    before = every_row()
    with pytest.raises(InvalidLeaseSeconds) as caught:
        claim(step, lease_seconds=bad_lease_seconds(value))
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == "lease_seconds"
    assert "lease_seconds" in str(caught.value)
    assert every_row() == before


@BAD_LEASE_SECONDS
def test_renew_refuses_bad_lease_seconds_and_keeps_the_lease(step, value):
    factories.committed(step)
    lease = held(step)
    before = state(lease.delivery_id)
    with pytest.raises(InvalidLeaseSeconds) as caught:
        services.renew_delivery(lease, lease_seconds=bad_lease_seconds(value))
    assert caught.value.field == "lease_seconds"
    assert state(lease.delivery_id) == before


def test_lease_default_and_maximum_are_read_on_each_access(step, raw):
    factories.committed(step)
    first, second, third = step.targets
    with override_settings(
        WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS=17, WORKFLOW_DELIVERY_MAX_LEASE_SECONDS=30
    ):
        (lease, record), before, after = timed(raw, claim, step, first)
        assert before + seconds(17) <= record.lease_until <= after + seconds(17)
        renewed, before, after = timed(raw, services.renew_delivery, lease, lease_seconds=30)
        assert before + seconds(30) <= renewed.lease_until <= after + seconds(30)
        renewed, before, after = timed(raw, services.renew_delivery, lease)
        assert before + seconds(17) <= renewed.lease_until <= after + seconds(17)
        with pytest.raises(InvalidLeaseSeconds):
            services.renew_delivery(lease, lease_seconds=31)
        with pytest.raises(InvalidLeaseSeconds):
            claim(step, second, lease_seconds=31)
    longest, before, after = timed(raw, held, step, third, lease_seconds=31)
    assert before + seconds(31) <= longest.lease_until <= after + seconds(31)
    default = seconds(app_settings.DEFAULT_LEASE_SECONDS)
    usual, before, after = timed(raw, held, step, second)
    assert before + default <= usual.lease_until <= after + default


# --- renew and finish --------------------------------------------------------------------


def test_renew_moves_the_lease_end_by_the_database_clock(step, raw):
    factories.committed(step)
    lease = held(step, lease_seconds=5)
    renewed, before, after = timed(raw, services.renew_delivery, lease, lease_seconds=300)
    assert before + seconds(300) <= renewed.lease_until <= after + seconds(300)
    assert state(lease.delivery_id)["lease_until"] == renewed.lease_until
    assert state(lease.delivery_id)["lease_generation"] == lease.generation


FORGERIES: dict[str, Callable[[Lease], Lease]] = {
    "older generation": lambda lease: dataclasses.replace(lease, generation=lease.generation - 1),
    "newer generation": lambda lease: dataclasses.replace(lease, generation=lease.generation + 1),
    "other target": lambda lease: dataclasses.replace(lease, target_pubkey=factories.key32()),
    "other community": lambda lease: dataclasses.replace(lease, community_id=uuid.uuid4()),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_renew_and_finish_are_fenced_by_generation_and_target(step, forgery):
    """Invariant 4 (generation, target): a lease that is not the current one changes nothing."""
    factories.committed(step)
    lease = held(step)
    forged = FORGERIES[forgery](lease)
    before = state(lease.delivery_id)
    assert services.renew_delivery(forged) == LeaseLost()
    assert services.finish_delivery(forged, Outcome.FINISHED) == LeaseLost()
    assert state(lease.delivery_id) == before
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def test_expired_lease_cannot_renew_or_finish_even_before_the_reaper(step, raw):
    """Invariant 4 (expiry)."""
    factories.committed(step)
    lease = held(step)
    expire(raw, lease.delivery_id)
    before = state(lease.delivery_id)
    assert services.renew_delivery(lease) == LeaseLost()
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    assert state(lease.delivery_id) == before
    assert before["status"] == "claimed"


def test_lease_still_running_by_the_statement_clock_is_held_and_not_reaped(step, raw):
    """The holder may act while ``lease_until >= statement_timestamp()``; the reaper
    only once it is past, by the clock of the statement that asks."""
    factories.committed(step)
    lease = held(step)
    raw.execute(
        "UPDATE workflow_agent_deliveries SET lease_until = statement_timestamp() "
        "+ interval '2 seconds' WHERE id = %s",
        [lease.delivery_id],
    )
    assert services.reap_expired_deliveries() == 0
    assert isinstance(services.renew_delivery(lease, lease_seconds=1), Renewed)


def test_finish_refuses_an_unknown_outcome(step):
    factories.committed(step)
    lease = held(step)
    before = state(lease.delivery_id)
    with pytest.raises(ProtocolError) as caught:
        services.finish_delivery(lease, "done")
    assert caught.value.field == "outcome"
    assert state(lease.delivery_id) == before


@pytest.mark.parametrize("outcome", list(Outcome))
def test_finish_is_terminal_once_and_a_retry_reports_the_recorded_status(step, raw, outcome):
    """Invariant 6: a retry converges on the recorded outcome and never flips it."""
    factories.committed(step)
    lease = held(step)
    result, before, after = timed(raw, services.finish_delivery, lease, outcome)
    assert result == Settled(outcome)
    settled = state(lease.delivery_id)
    assert before <= settled.pop("finished_at") <= after
    assert settled == {
        "status": outcome.value,
        "lease_generation": lease.generation,
        "lease_until": None,
        "claimed_at": None,
    }
    settled = state(lease.delivery_id)
    recorded = AlreadyTerminal(DeliveryStatus(outcome.value))
    for attempt in Outcome:
        assert services.finish_delivery(lease, attempt) == recorded
    assert services.renew_delivery(lease) == LeaseLost()
    assert claim(step, delivery_id=lease.delivery_id) is None
    assert state(lease.delivery_id) == settled


# --- reap --------------------------------------------------------------------------------


def test_reap_reclaims_an_expired_lease_and_fences_out_the_prior_holder(step, raw):
    """Invariant 5."""
    factories.committed(step)
    lease = held(step)
    expire(raw, lease.delivery_id)
    assert services.reap_expired_deliveries() == 1
    reclaimed = state(lease.delivery_id)
    assert reclaimed == {
        "status": "pending",
        "lease_generation": lease.generation + 1,
        "lease_until": None,
        "claimed_at": None,
        "finished_at": None,
    }
    assert services.renew_delivery(lease) == LeaseLost()
    for outcome in Outcome:
        assert services.finish_delivery(lease, outcome) == LeaseLost()
    assert state(lease.delivery_id) == reclaimed
    again = held(step)
    assert (again.delivery_id, again.generation) == (lease.delivery_id, lease.generation + 2)
    assert services.finish_delivery(again, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def test_stale_holder_whose_row_was_settled_by_a_newer_holder_gets_lease_lost(step, raw):
    """Invariant 6: not AlreadyTerminal, which would let a stale holder believe it had settled."""
    factories.committed(step)
    stale = held(step)
    expire(raw, stale.delivery_id)
    assert services.reap_expired_deliveries() == 1
    newer = held(step)
    assert services.finish_delivery(newer, Outcome.FAILED) == Settled(Outcome.FAILED)
    assert services.finish_delivery(stale, Outcome.FINISHED) == LeaseLost()
    assert services.finish_delivery(newer, Outcome.FINISHED) == AlreadyTerminal(
        DeliveryStatus.FAILED
    )
    assert state(stale.delivery_id)["status"] == "failed"


@pytest.mark.parametrize("deletion_state", NOT_ACTIVE)
def test_reaper_skips_a_non_active_community_and_reclaims_healthy_ones(raw, deletion_state):
    """Invariant 7: the fenced tenant's row stays claimed; a direct write to it is refused."""
    healthy, frozen = factories.Step(), factories.Step()
    factories.committed(healthy)
    factories.committed(frozen)
    healthy_lease, frozen_lease = held(healthy), held(frozen)
    expire(raw, healthy_lease.delivery_id, frozen_lease.delivery_id)
    factories.move_to(frozen.community.id, deletion_state)
    before = state(frozen_lease.delivery_id)
    assert services.reap_expired_deliveries() == 1
    assert state(healthy_lease.delivery_id)["status"] == "pending"
    assert state(frozen_lease.delivery_id) == before
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        raw.execute(
            "UPDATE workflow_agent_deliveries SET status = 'pending', lease_until = NULL, "
            "claimed_at = NULL, lease_generation = lease_generation + 1 WHERE id = %s",
            [frozen_lease.delivery_id],
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert state(frozen_lease.delivery_id) == before


def test_service_writes_to_a_fenced_community_are_refused(step):
    factories.committed(step)
    lease = held(step)
    factories.move_to(step.community.id, "fenced")
    before = every_row()
    attempts = [
        lambda: services.renew_delivery(lease),
        lambda: services.finish_delivery(lease, Outcome.FINISHED),
        lambda: claim(step, step.targets[1]),
        lambda: services.commit_deliveries(
            step.community.id, step.created_at, [NewDelivery(uuid.uuid4(), step.binding())]
        ),
    ]
    for attempt in attempts:
        with pytest.raises(CommunityWriteFenced), transaction.atomic():
            attempt()
    assert every_row() == before


def test_reap_in_small_batches_returns_the_full_total(raw):
    step = factories.Step(targets=7)
    factories.committed(step)
    leases = [held(step, target) for target in step.targets]
    expire(raw, *(lease.delivery_id for lease in leases))
    batches: list[int] = []
    assert (
        services.reap_expired_deliveries(batch_size=2, on_batch=lambda n, _: batches.append(n)) == 7
    )
    assert batches == [2, 2, 2, 1]
    assert {state(lease.delivery_id)["status"] for lease in leases} == {"pending"}
    assert services.reap_expired_deliveries(batch_size=2) == 0


def test_reap_batch_size_defaults_to_the_setting_read_on_access(raw):
    step = factories.Step(targets=6)
    factories.committed(step)
    expire(raw, *(held(step, target).delivery_id for target in step.targets))
    batches: list[int] = []
    with override_settings(WORKFLOW_DELIVERY_REAP_BATCH_SIZE=3):
        assert services.reap_expired_deliveries(on_batch=lambda n, _: batches.append(n)) == 6
    assert batches == [3, 3, 0]


@pytest.mark.parametrize("size", [0, -1, 1.5, True], ids=repr)
def test_reap_refuses_a_bad_batch_size(size):
    with pytest.raises(ProtocolError) as caught:
        services.reap_expired_deliveries(batch_size=size)
    assert caught.value.field == "batch_size"


def test_reap_rests_after_each_full_batch_in_proportion_to_it(raw, monkeypatch):
    step = factories.Step(targets=5)
    factories.committed(step)
    expire(raw, *(held(step, target).delivery_id for target in step.targets))
    timings: list[float] = []
    rests: list[float] = []
    monkeypatch.setattr(services.maintenance.time, "sleep", rests.append)
    reclaimed = services.reap_expired_deliveries(
        batch_size=2, yield_ratio=1.5, on_batch=lambda _, seconds: timings.append(seconds)
    )
    assert reclaimed == 5
    # Two full batches rest; the last, partial one ends the sweep at once.
    assert rests == pytest.approx([1.5 * timings[0], 1.5 * timings[1]])


def test_reap_with_yield_ratio_zero_never_rests(raw, monkeypatch):
    step = factories.Step(targets=4)
    factories.committed(step)
    expire(raw, *(held(step, target).delivery_id for target in step.targets))
    rests: list[float] = []
    monkeypatch.setattr(services.maintenance.time, "sleep", rests.append)
    assert services.reap_expired_deliveries(batch_size=2, yield_ratio=0) == 4
    assert rests == []


@pytest.mark.parametrize("ratio", [-1, "1", True, 101], ids=repr)
def test_reap_refuses_a_bad_yield_ratio(ratio):
    with pytest.raises(ProtocolError) as caught:
        services.reap_expired_deliveries(yield_ratio=ratio)
    assert caught.value.field == "yield_ratio"


# --- cascades and reads ------------------------------------------------------------------

PARENTS: dict[str, Callable[[factories.Step], object]] = {
    "run": lambda step: WorkflowRun.objects.filter(pk=step.run.pk).delete(),
    "workflow": lambda step: Workflow.objects.filter(pk=step.workflow.pk).delete(),
    "message event": lambda step: Event.objects.filter(pk=step.message.pk).delete(),
}


@pytest.mark.parametrize("parent", list(PARENTS))
def test_deleting_the_parent_deletes_its_deliveries(parent):
    """Invariant 8."""
    doomed = factories.Step(targets=2)
    survivor = factories.Step(doomed.community)
    factories.committed(doomed)
    (kept,) = factories.committed(survivor)
    held(doomed)
    PARENTS[parent](doomed)
    assert [row["id"] for row in every_row()] == [kept.id]


def test_get_is_scoped_to_its_community(step):
    delivery = factories.committed(step)[0]
    other = factories.community()
    assert services.get_delivery(other.id, delivery.id) is None
    assert services.get_delivery(step.community.id, uuid.uuid4()) is None
    record = services.get_delivery(str(step.community.id), str(delivery.id))
    assert (record.id, record.binding) == (delivery.id, delivery.binding)


@pytest.mark.parametrize("path", ["commit_deliveries", "delivery_identity"])
def test_a_step_whose_deliveries_differ_beyond_their_targets_stores_each_as_given(step, path):
    """The usual step binds its shared columns once; one whose definitions or causes
    differ between targets takes the per-column form, and each row keeps its own."""
    bindings = [
        step.binding(step.targets[0]),
        step.binding(step.targets[1], definition_event_id=b"\x11" * 32),
        step.binding(step.targets[2], cause=ScheduleCause(datetime(2031, 1, 2, tzinfo=UTC))),
    ]
    deliveries = [NewDelivery(uuid.uuid4(), binding) for binding in bindings]
    if path == "commit_deliveries":
        created = services.commit_deliveries(step.community.id, step.created_at, deliveries)
    else:
        with services.delivery_identity(step.community.id, step.run.id, step.step_id) as held:
            created = held.commit(step.created_at, deliveries)
    assert sorted(created) == sorted(item.id for item in deliveries)
    for item in deliveries:
        assert services.get_delivery(step.community.id, item.id).binding == item.binding
    again = [NewDelivery(uuid.uuid4(), binding) for binding in bindings]
    assert services.commit_deliveries(step.community.id, step.created_at, again) == []
