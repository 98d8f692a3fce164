"""``services.holding()``: lease-fenced effects on real PostgreSQL, real connections.

The effect table stands for the agent's own rows; it is created for each test in the
test database and dropped after.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from uuid import UUID

import pytest
from django.db import connection, transaction

from tests.support import factories
from tests.support.consumers import Running, consumer_for
from workflow_delivery import services
from workflow_delivery.exceptions import LeaseNotLive, ProtocolError
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus, Lease, Outcome, Settled
from workflow_delivery.store import statements as sql

pytestmark = pytest.mark.django_db(transaction=True)

EFFECTS = "wd_test_holding_effect"


@pytest.fixture
def effects() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {EFFECTS} (delivery_id uuid NOT NULL, holder text NOT NULL, "
            "generation integer NOT NULL)"
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {EFFECTS}")


def write_effect(lease: Lease, holder: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS} VALUES (%s, %s, %s)",
            [lease.delivery_id, holder, lease.generation],
        )


def effect_rows(delivery_id: UUID) -> list[tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT holder, generation FROM {EFFECTS} WHERE delivery_id = %s", [delivery_id]
        )
        return cursor.fetchall()


def status_of(lease: Lease) -> DeliveryStatus:
    return DeliveryStatus(WorkflowAgentDelivery.objects.get(id=lease.delivery_id).status)


def claim(step: factories.Step, seconds: int = 3) -> Lease:
    claimed = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=seconds)
    assert claimed is not None
    return claimed[0]


@pytest.fixture
def elsewhere() -> Iterator[Callable[..., Any]]:
    """Run a function on another thread, hence on another connection; returns a Future."""
    pool = ThreadPoolExecutor(max_workers=2)

    def submit(function: Callable[..., Any], *args: Any):
        def run() -> Any:
            try:
                return function(*args)
            finally:
                connection.close()

        return pool.submit(run)

    yield submit
    pool.shutdown(wait=True)


@pytest.fixture
def step(db) -> factories.Step:
    built = factories.Step(targets=1)
    factories.committed(built)
    return built


def test_writes_commit_with_the_finish(step, effects):
    lease = claim(step)
    with services.holding(lease) as held:
        write_effect(lease, "a")
        assert held.finish(Outcome.FINISHED) == Settled(outcome=Outcome.FINISHED)
    assert effect_rows(lease.delivery_id) == [("a", lease.generation)]
    assert status_of(lease) == DeliveryStatus.FINISHED


def test_a_block_that_raises_commits_nothing(step, effects):
    lease = claim(step)

    class HandlerBroke(Exception):
        pass

    with pytest.raises(HandlerBroke), services.holding(lease) as held:
        write_effect(lease, "a")
        held.finish(Outcome.FINISHED)
        raise HandlerBroke
    assert effect_rows(lease.delivery_id) == []
    assert status_of(lease) == DeliveryStatus.CLAIMED
    # The lease is untouched: a later block still holds it.
    with services.holding(lease) as held:
        held.finish("failed")
    assert status_of(lease) == DeliveryStatus.FAILED


def test_an_unfinished_block_commits_its_writes_under_the_live_lease(step, effects):
    lease = claim(step)
    with services.holding(lease):
        write_effect(lease, "a")
    assert effect_rows(lease.delivery_id) == [("a", lease.generation)]
    assert status_of(lease) == DeliveryStatus.CLAIMED


def lose_by_reap(step: factories.Step, lease: Lease) -> None:
    time.sleep(1.2)
    assert services.reap_expired_deliveries() == 1


def lose_by_release(step: factories.Step, lease: Lease) -> None:
    assert services.release_deliveries(step.community.id, [lease.delivery_id])


def lose_by_supersede(step: factories.Step, lease: Lease) -> None:
    lose_by_release(step, lease)
    assert claim(step).generation == lease.generation + 2


def lose_by_settle(step: factories.Step, lease: Lease) -> None:
    assert services.finish_delivery(lease, "finished") == Settled(Outcome.FINISHED)


@pytest.mark.parametrize("lose", [lose_by_reap, lose_by_release, lose_by_supersede, lose_by_settle])
def test_a_lost_lease_is_refused_on_entry(step, effects, lose):
    lease = claim(step, seconds=1)
    lose(step, lease)
    with pytest.raises(LeaseNotLive), services.holding(lease):
        write_effect(lease, "stale")
    assert effect_rows(lease.delivery_id) == []


def test_a_lease_that_expires_while_waiting_for_the_row_is_refused(step, effects, elsewhere):
    lease = claim(step, seconds=1)
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT 1 FROM {sql.DELIVERIES} WHERE id = %s FOR UPDATE",
                [lease.delivery_id],
            )
            locked.set()
            assert release.wait(10)

    other = elsewhere(hold_the_row)
    assert locked.wait(10)
    # Let go of the row only after the lease has run out, while holding() waits.
    threading.Timer(1.5, release.set).start()
    started = time.monotonic()
    entered = []
    with pytest.raises(LeaseNotLive), services.holding(lease):
        entered.append(True)
    assert time.monotonic() - started >= 1.0
    assert entered == [], "the refusal comes on entry, before the block runs"
    other.result(timeout=10)
    assert effect_rows(lease.delivery_id) == []


def test_the_reaper_skips_a_row_held_by_an_open_block(step, effects, elsewhere):
    lease = claim(step, seconds=1)
    with pytest.raises(LeaseNotLive), services.holding(lease):
        write_effect(lease, "slow")
        time.sleep(1.5)
        # The lease has run out, but the block holds the row: another connection's
        # reaper passes it by and nobody can claim it.
        assert elsewhere(services.reap_expired_deliveries).result(timeout=10) == 0
        claimed = elsewhere(services.claim_delivery, step.community.id, step.targets[0]).result(
            timeout=10
        )
        assert claimed is None
    # The block outlived its lease, so its writes rolled back; now the reaper can act.
    assert effect_rows(lease.delivery_id) == []
    assert services.reap_expired_deliveries() == 1


def test_a_finish_after_the_lease_ran_out_inside_the_block_rolls_everything_back(step, effects):
    lease = claim(step, seconds=1)
    with pytest.raises(LeaseNotLive), services.holding(lease) as held:
        write_effect(lease, "slow")
        time.sleep(1.2)
        # Swallowed by the caller: the block must still refuse to commit.
        with contextlib.suppress(LeaseNotLive):
            held.finish("finished")
    assert effect_rows(lease.delivery_id) == []
    assert status_of(lease) == DeliveryStatus.CLAIMED


def test_a_stale_holders_writes_never_commit(step, effects):
    stale = claim(step, seconds=1)
    time.sleep(1.2)
    assert services.reap_expired_deliveries() == 1
    fresh = claim(step)
    with pytest.raises(LeaseNotLive), services.holding(stale):
        write_effect(stale, "stale")
    with services.holding(fresh) as held:
        write_effect(fresh, "fresh")
        held.finish("finished")
    with pytest.raises(LeaseNotLive), services.holding(stale):
        write_effect(stale, "stale")
    assert effect_rows(stale.delivery_id) == [("fresh", fresh.generation)]


def test_of_two_blocks_on_one_lease_only_the_first_to_finish_commits(step, effects, elsewhere):
    lease = claim(step)
    inside, go = threading.Event(), threading.Event()

    def first() -> None:
        with services.holding(lease) as held:
            write_effect(lease, "first")
            inside.set()
            assert go.wait(10)
            held.finish("finished")

    def second() -> None:
        with services.holding(lease) as held:
            write_effect(lease, "second")
            held.finish("finished")

    one = elsewhere(first)
    assert inside.wait(10)
    two = elsewhere(second)
    time.sleep(0.3)  # the second block now waits for the row
    go.set()
    one.result(timeout=10)
    with pytest.raises(LeaseNotLive):
        two.result(timeout=10)
    assert effect_rows(lease.delivery_id) == [("first", lease.generation)]


def test_bad_outcome_is_refused_and_nothing_is_stored(step, effects):
    lease = claim(step)
    with pytest.raises(ProtocolError) as error, services.holding(lease) as held:
        write_effect(lease, "a")
        held.finish("done")
    assert error.value.field == "outcome"
    assert effect_rows(lease.delivery_id) == []
    assert status_of(lease) == DeliveryStatus.CLAIMED


def test_holding_needs_a_lease(db):
    with pytest.raises(ProtocolError) as error, services.holding("not a lease"):  # type: ignore[arg-type]
        pass
    assert error.value.field == "lease"


def test_a_holder_gives_back_only_its_own_live_lease(step):
    stale = claim(step, seconds=1)
    assert services.release_lease(stale) is True
    assert status_of(stale) == DeliveryStatus.PENDING
    fresh = claim(step)
    assert fresh.generation == stale.generation + 2
    # The old capability cannot touch the newer holder's claim.
    assert services.release_lease(stale) is False
    assert status_of(fresh) == DeliveryStatus.CLAIMED
    assert services.finish_delivery(fresh, "finished") == Settled(Outcome.FINISHED)


@pytest.mark.django_db(transaction=True)
def test_a_renew_that_meets_the_handlers_own_block_leaves_the_lease_live():
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)
    seen_lost: list[bool] = []

    def long_block(record, lease, context) -> None:
        # The block holds the row across at least one beat (every 2/3 s), whose renew
        # then times out behind it: busy, and the lease still the handler's. The block
        # does not settle, so the consumer finishes the delivery after the handler.
        with context.holding():
            time.sleep(1.5)
        seen_lost.append(context.lost.is_set())

    consumer = consumer_for(step, long_block, lease_seconds=2, max_deliveries=1)
    with Running(consumer) as running:
        stats = running.join(20)
    assert stats.renew_busy >= 1, stats
    assert seen_lost == [False]
    assert stats.finished == 1 and stats.lost == 0, stats
    assert WorkflowAgentDelivery.objects.get(pk=delivery.id).status == "finished"
