"""Invariant 10 of SPEC §7 under real concurrency: threads, each on its own connection.

Races between a reaper and a finishing holder are reproduced deterministically: a second
connection, driven step by step from the test, holds the row lock while the other acts.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise

import pytest
from django.db import connection, transaction

from tests.support import factories
from tests.support.races import (
    GIVE_UP_SECONDS,
    Session,
    begin,
    commit,
    limit_lock_waits,
    run_together,
    scalar,
    state,
)
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryRecord,
    DeliveryStatus,
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    Renewed,
    Settled,
)

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = 8
TARGETS = 4
STEPS = 90  # x TARGETS = 360 deliveries


def end_leases_at(instant: datetime, *delivery_ids: uuid.UUID) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = %s WHERE id = ANY(%s)",
            [instant, list(delivery_ids)],
        )


@pytest.fixture
def lock_timeout(transactional_db):
    limit_lock_waits()
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


# --- many holders, one reaper ------------------------------------------------------------


@dataclass
class Hold:
    """One lease as its holder saw it, from claim to its last word."""

    lease: Lease
    claimed_at: datetime
    live_until: datetime
    abandoned: bool = False
    renewed: Renewed | LeaseLost | None = None
    finished: Settled | AlreadyTerminal | LeaseLost | None = None
    retried: Settled | AlreadyTerminal | LeaseLost | None = None


def abandons(lease: Lease) -> bool:
    """A fifth of the deliveries lose their first holder, who stalls past its lease."""
    return lease.generation == 1 and lease.delivery_id.int % 5 == 0


def test_many_holders_never_share_a_delivery_and_each_settles_exactly_once():
    owner = factories.community()
    targets = [factories.key32() for _ in range(TARGETS)]
    deliveries = [
        item
        for index in range(STEPS)
        for item in factories.committed(factories.Step(owner, targets, step_id=f"s{index}"))
    ]
    total = len(deliveries)
    settled = Counter()
    settled_lock = threading.Lock()
    done = threading.Event()
    deadline = time.monotonic() + GIVE_UP_SECONDS

    def finished_everything() -> bool:
        return done.is_set() or time.monotonic() > deadline

    def hold(lease: Lease, record: DeliveryRecord) -> Hold:
        held = Hold(lease, record.claimed_at, record.lease_until)
        if abandons(lease):
            # The holder stalls: its lease ends where it began, so the reaper may take it.
            held.abandoned = True
            held.live_until = scalar(
                "UPDATE workflow_agent_deliveries SET lease_until = claimed_at "
                "WHERE id = %s AND lease_generation = %s RETURNING lease_until",
                [lease.delivery_id, lease.generation],
            )
            held.finished = services.finish_delivery(lease, Outcome.FINISHED)
            return held
        held.renewed = services.renew_delivery(lease, lease_seconds=600)
        if isinstance(held.renewed, Renewed):
            held.live_until = held.renewed.lease_until
        outcome = Outcome.FINISHED if lease.delivery_id.int % 2 else Outcome.FAILED
        held.finished = services.finish_delivery(lease, outcome)
        held.retried = services.finish_delivery(lease, Outcome.FINISHED)
        if isinstance(held.finished, Settled):
            with settled_lock:
                settled["total"] += 1
                if settled["total"] == total:
                    done.set()
        return held

    def claimer(index: int) -> list[Hold]:
        holds, turn = [], index
        while not finished_everything():
            claimed = services.claim_delivery(owner.id, targets[turn % TARGETS])
            turn += 1
            if claimed is None:
                time.sleep(0.001)
                continue
            holds.append(hold(*claimed))
        return holds

    def reaper() -> int:
        reclaimed = 0
        while not finished_everything():
            reclaimed += services.reap_expired_deliveries(batch_size=8)
        return reclaimed

    *per_claimer, reclaimed = run_together(
        WORKERS + 1, lambda index: claimer(index) if index < WORKERS else reaper()
    )
    assert done.is_set(), f"only {settled['total']} of {total} deliveries settled"

    holds = [held for claimer_holds in per_claimer for held in claimer_holds]
    assert {len(claimer_holds) > 0 for claimer_holds in per_claimer} == {True}
    leases = [(held.lease.delivery_id, held.lease.generation) for held in holds]
    assert len(leases) == len(set(leases)), "a (delivery, generation) was held twice"

    by_delivery: dict[uuid.UUID, list[Hold]] = defaultdict(list)
    for held in holds:
        by_delivery[held.lease.delivery_id].append(held)
    assert set(by_delivery) == {item.id for item in deliveries}
    rows = {
        row["id"]: row
        for row in WorkflowAgentDelivery.objects.values("id", "status", "lease_generation")
    }
    for delivery_id, history in by_delivery.items():
        history.sort(key=lambda held: held.lease.generation)
        for earlier, later in pairwise(history):
            assert later.claimed_at > earlier.live_until, "two live leases overlapped"
        *superseded, last = history
        assert [held.finished for held in superseded] == [LeaseLost()] * len(superseded)
        assert all(held.abandoned for held in superseded)
        assert isinstance(last.finished, Settled)
        assert isinstance(last.renewed, Renewed)
        assert last.retried == AlreadyTerminal(DeliveryStatus(last.finished.outcome.value))
        assert rows[delivery_id] == {
            "id": delivery_id,
            "status": last.finished.outcome.value,
            "lease_generation": last.lease.generation,
        }
    assert reclaimed == sum(held.abandoned for held in holds)
    assert reclaimed == sum(1 for item in deliveries if item.id.int % 5 == 0)


# --- racing producers --------------------------------------------------------------------


def test_racing_producers_of_one_step_create_one_row_per_target():
    step = factories.Step(targets=TARGETS)

    def produce(index: int) -> tuple[bool, list[NewDelivery], list[uuid.UUID]]:
        # Each producer addresses an overlapping slice of the step's targets.
        mine = [step.targets[(index + offset) % TARGETS] for offset in range(TARGETS - 1)]
        with services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity:
            existed = identity.exists
            if existed:
                row = WorkflowAgentDelivery.objects.filter(run=step.run).first()
                message_id, created_at = bytes(row.message_event_id), row.message_event_created_at
            else:
                signed = factories.message(step.community, step.targets)
                message_id, created_at = bytes(signed.id), signed.created_at
            batch = [
                NewDelivery(uuid.uuid4(), step.binding(target, message_event_id=message_id))
                for target in mine
            ]
            return existed, batch, identity.commit(created_at, batch)

    results = run_together(WORKERS, produce)

    rows = list(WorkflowAgentDelivery.objects.filter(run=step.run).values())
    assert sorted(bytes(row["target_pubkey"]) for row in rows) == sorted(step.targets)
    assert [existed for existed, _, _ in results].count(False) == 1, "one producer signs"
    assert len({bytes(row["message_event_id"]) for row in rows}) == 1
    created = [delivery_id for _, _, ids in results for delivery_id in ids]
    assert sorted(created) == sorted(row["id"] for row in rows), "each id created once"
    for _, batch, ids in results:
        proposed = {item.id: item.binding.target_pubkey for item in batch}
        for delivery_id in ids:
            row = next(row for row in rows if row["id"] == delivery_id)
            assert bytes(row["target_pubkey"]) == proposed[delivery_id]


def test_racing_one_shot_commits_create_each_delivery_once():
    step = factories.Step(targets=TARGETS)
    results = run_together(
        WORKERS,
        lambda _: services.commit_deliveries(
            step.community.id, step.created_at, step.new_deliveries()
        ),
    )
    assert sorted(len(ids) for ids in results) == [0] * (WORKERS - 1) + [TARGETS]
    (winner,) = [ids for ids in results if ids]
    stored = WorkflowAgentDelivery.objects.filter(run=step.run).values_list("id", flat=True)
    assert sorted(stored) == sorted(winner)


# --- a reaper racing a finishing holder ----------------------------------------------------


def test_reaper_skips_a_row_whose_holder_is_finishing(lock_timeout):
    step = factories.Step(targets=2)
    factories.committed(step)
    finishing, _ = services.claim_delivery(step.community.id, step.targets[0])
    idle, _ = services.claim_delivery(step.community.id, step.targets[1])
    holder = Session()
    try:
        # Both leases end in a moment: the holder settles while its lease is live (by
        # its statement's clock) and keeps its transaction open past the lease's end.
        ends = scalar("SELECT statement_timestamp() + interval '1 second'")
        end_leases_at(ends, finishing.delivery_id, idle.delivery_id)
        holder.call(begin)
        assert holder.call(services.finish_delivery, finishing, Outcome.FINISHED) == Settled(
            Outcome.FINISHED
        )
        while scalar("SELECT statement_timestamp() <= %s", [ends]):
            time.sleep(0.05)
        assert services.reap_expired_deliveries() == 1
        assert state(finishing.delivery_id) == {
            "status": "claimed",
            "lease_generation": finishing.generation,
        }
        assert state(idle.delivery_id)["status"] == "pending"
        holder.call(commit)
    finally:
        holder.close()
    assert state(finishing.delivery_id) == {
        "status": "finished",
        "lease_generation": finishing.generation,
    }
    assert services.reap_expired_deliveries() == 0
    assert services.finish_delivery(finishing, Outcome.FAILED) == AlreadyTerminal(
        DeliveryStatus.FINISHED
    )


def test_holder_finishing_after_a_reaper_reclaimed_its_row_loses_without_waiting(lock_timeout):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    holder = Session()
    try:
        holder.call(begin)
        end_leases_at(
            scalar("SELECT statement_timestamp() - interval '1 second'"), lease.delivery_id
        )
        with transaction.atomic():
            assert services.reap_expired_deliveries() == 1
            # The reaper has not committed: by the holder's statement clock its lease is
            # over, so it loses at once instead of queueing behind the reaper's row lock.
            assert holder.call(services.finish_delivery, lease, Outcome.FINISHED) == LeaseLost()
        holder.call(commit)
    finally:
        holder.close()
    assert state(lease.delivery_id) == {
        "status": "pending",
        "lease_generation": lease.generation + 1,
    }
    again, _ = services.claim_delivery(step.community.id, step.targets[0])
    assert again.generation == lease.generation + 2
    assert services.finish_delivery(again, Outcome.FINISHED) == Settled(Outcome.FINISHED)


def test_concurrent_reapers_skip_each_others_rows_and_reclaim_each_once(lock_timeout):
    step = factories.Step(targets=3)
    factories.committed(step)
    leases = [services.claim_delivery(step.community.id, t)[0] for t in step.targets]
    ids = [lease.delivery_id for lease in leases]
    end_leases_at(scalar("SELECT now() - interval '1 second'"), *ids)
    other = Session()
    try:
        with transaction.atomic():
            assert services.reap_expired_deliveries(batch_size=2) == 3
            assert other.call(services.reap_expired_deliveries) == 0
        assert other.call(services.reap_expired_deliveries) == 0
    finally:
        other.close()
    assert [state(delivery_id) for delivery_id in ids] == [
        {"status": "pending", "lease_generation": 2}
    ] * 3
