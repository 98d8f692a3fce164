"""A purge and the community's writers take their locks in one order: the community's
deletion lock first, then delivery rows. So a purge (holding the exclusive lock while
it deletes the rows) never deadlocks with a holder inside ``holding()`` or with a
claim, renew or finish that arrives while it runs: the writer waits for the purge, or
the purge for the writer, and neither gets ``deadlock detected``.

Each race is driven step by step on real connections: the test waits until one side
is blocked on a lock before it lets the other go on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction

from tests.support import factories
from tests.support.locks import wait_until_blocked
from tests.support.races import scalar
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, LeaseNotLive, PurgeDeadlocked
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import Lease, LeaseLost, Outcome
from workflow_delivery.store import statements as sql

pytestmark = pytest.mark.django_db(transaction=True)

# A lock wait that should have ended fails the test rather than hanging it.
LOCK_TIMEOUT = "20s"


@pytest.fixture
def elsewhere() -> Iterator[Callable[..., tuple[Future, int]]]:
    """Run ``function`` on a thread of its own (so on a connection of its own) and
    return its Future and that connection's backend pid, known before it starts."""
    pool = ThreadPoolExecutor(max_workers=3)

    def submit(function: Callable[..., Any], *args: Any) -> tuple[Future, int]:
        pids: queue.Queue[int] = queue.Queue()

        def run() -> Any:
            try:
                scalar("SELECT set_config('lock_timeout', %s, false)", [LOCK_TIMEOUT])
                pids.put(scalar("SELECT pg_backend_pid()"))
                return function(*args)
            finally:
                connection.close()

        future = pool.submit(run)
        return future, pids.get(timeout=30)

    yield submit
    pool.shutdown(wait=True)


def fenced_with_lease(seconds: int = 60) -> tuple[factories.Step, Lease, int]:
    """A step of two deliveries, one claimed, whose community is then fenced."""
    step = factories.Step(targets=2)
    factories.committed(step)
    claimed = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=seconds)
    assert claimed is not None
    generation = factories.move_to(step.community.id, "fenced")
    return step, claimed[0], generation


def remaining(step: factories.Step) -> int:
    return WorkflowAgentDelivery.objects.filter(community=step.community).count()


def test_a_holder_finishing_inside_holding_does_not_deadlock_a_purge(elsewhere):
    step, lease, generation = fenced_with_lease()
    inside, go = threading.Event(), threading.Event()

    def hold() -> None:
        with services.holding(lease) as held:
            inside.set()
            assert go.wait(30)
            held.finish(Outcome.FINISHED)

    holder, _ = elsewhere(hold)
    assert inside.wait(30)
    purge, purge_pid = elsewhere(services.purge_community, step.community.id, generation)
    # The purge waits for the community's deletion lock, which the holder's block shares.
    wait_until_blocked(purge_pid)
    go.set()
    # The holder's finish asks the fence; the community is fenced, so it is refused
    # by name and the block rolls back. Never a deadlock.
    with pytest.raises(CommunityWriteFenced):
        holder.result(timeout=60)
    deleted = purge.result(timeout=60)
    assert deleted[WorkflowAgentDelivery._meta.db_table] == 2
    assert remaining(step) == 0


def test_a_deletion_waits_for_a_holder_inside_holding_whose_finish_commits(elsewhere):
    step = factories.Step(targets=1)
    factories.committed(step)
    claimed = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
    assert claimed is not None
    lease = claimed[0]
    inside, go = threading.Event(), threading.Event()

    def hold() -> object:
        with services.holding(lease) as held:
            inside.set()
            assert go.wait(30)
            return held.finish(Outcome.FINISHED)

    holder, _ = elsewhere(hold)
    assert inside.wait(30)
    # The holder passed the fence when it entered: the deletion waits for its block.
    quiesce, quiesce_pid = elsewhere(services.begin_deletion, step.community.id)
    wait_until_blocked(quiesce_pid)
    go.set()
    assert holder.result(timeout=60).outcome == Outcome.FINISHED
    quiesce.result(timeout=60)
    assert Community.objects.get(pk=step.community.id).deletion_state == "quiescing"
    assert WorkflowAgentDelivery.objects.get(pk=lease.delivery_id).status == "finished"


def renew(step: factories.Step, lease: Lease) -> object:
    return services.renew_delivery(lease, lease_seconds=60)


def finish(step: factories.Step, lease: Lease) -> object:
    return services.finish_delivery(lease, Outcome.FINISHED)


def retry(step: factories.Step, lease: Lease) -> object:
    return services.retry_delivery(lease, error="boom")


def fail(step: factories.Step, lease: Lease) -> object:
    return services.finish_delivery(lease, Outcome.FAILED, error="boom")


def release(step: factories.Step, lease: Lease) -> object:
    return services.release_lease(lease)


def claim(step: factories.Step, lease: Lease) -> object:
    return services.claim_delivery(step.community.id, step.targets[1], lease_seconds=60)


def claim_batch(step: factories.Step, lease: Lease) -> object:
    return services.claim_deliveries(step.community.id, step.targets[1], limit=5)


def finish_batch(step: factories.Step, lease: Lease) -> object:
    return services.finish_deliveries([(lease, Outcome.FINISHED)])


def hold(step: factories.Step, lease: Lease) -> object:
    try:
        with services.holding(lease):
            pass
    except LeaseNotLive:
        return LeaseLost()
    return "held"


# What each writer gets once the purge has deleted its row.
NOTHING_LEFT = {
    renew: LeaseLost(),
    finish: LeaseLost(),
    retry: LeaseLost(),
    fail: LeaseLost(),
    release: False,
    claim: None,
    claim_batch: [],
    finish_batch: [LeaseLost()],
    hold: LeaseLost(),
}


@pytest.mark.parametrize("write", list(NOTHING_LEFT), ids=lambda write: write.__name__)
def test_a_writer_arriving_during_a_purge_waits_for_it_without_deadlock(elsewhere, write):
    step, lease, generation = fenced_with_lease()
    locked, go = threading.Event(), threading.Event()

    def purge() -> dict[str, int]:
        # The purge's own statements, paused between its exclusive lock and its
        # deletes, when a writer that locked a row first would deadlock it.
        deleted = {}
        with services.executor_writes(step.community.id, generation):
            locked.set()
            assert go.wait(30)
            with connection.cursor() as cursor:
                for table, purge in sql.PURGE:
                    params = {"community_id": str(step.community.id), "limit": 1000}
                    cursor.execute(purge.sql, purge.args(params))
                    deleted[table] = cursor.rowcount
        return deleted

    purging, _ = elsewhere(purge)
    assert locked.wait(30)
    writer, writer_pid = elsewhere(write, step, lease)
    wait_until_blocked(writer_pid)
    go.set()
    assert purging.result(timeout=60)[WorkflowAgentDelivery._meta.db_table] == 2
    assert writer.result(timeout=60) == NOTHING_LEFT[write]
    assert remaining(step) == 0


def test_the_writers_lock_is_the_fences_deletion_key(db):
    ids = [factories.community().id for _ in range(3)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {sql.DELETION_KEY.format(column='c.id')}, wd_community_deletion_key(c.id) "
            "FROM communities AS c WHERE c.id = ANY(%s)",
            [ids],
        )
        pairs = cursor.fetchall()
    assert len(pairs) == 3
    assert all(written == called for written, called in pairs)


def foreign_writer(step: factories.Step, holding_row: threading.Event, go: threading.Event):
    """Raw SQL outside the app: it locks a run of the community first, and only its
    UPDATE's fence trigger asks for the deletion lock. Its own deadlock check comes
    late, so the purge (1 s) is the one that finds the cycle."""

    def write() -> str:
        scalar("SELECT set_config('deadlock_timeout', '30s', false)")
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT id FROM workflow_runs WHERE id = %s FOR UPDATE", [step.run.id]
                )
                holding_row.set()
                assert go.wait(30)
                cursor.execute("UPDATE workflow_runs SET id = id WHERE id = %s", [step.run.id])
        except DatabaseError as exc:
            return exc.__cause__.diag.constraint_name
        return "written"

    return write


def test_a_purge_chosen_as_a_deadlocks_victim_tries_again(elsewhere):
    step, _lease, generation = fenced_with_lease()
    holding_row, go = threading.Event(), threading.Event()
    writer, _ = elsewhere(foreign_writer(step, holding_row, go))
    assert holding_row.wait(30)

    def purge() -> dict[str, int]:
        scalar("SELECT set_config('deadlock_timeout', '1s', false)")
        return services.purge_community(step.community.id, generation)

    purging, purge_pid = elsewhere(purge)
    wait_until_blocked(purge_pid)  # on the writer's run
    go.set()
    # The first try is the victim; the writer, let through, is refused by the fence
    # and ends; the second try deletes everything.
    assert purging.result(timeout=60)["workflow_runs"] == 1
    assert writer.result(timeout=60) == "wd_community_write_fence"
    assert remaining(step) == 0


def test_a_purge_in_the_callers_transaction_reports_the_deadlock_by_name(elsewhere):
    step, _lease, generation = fenced_with_lease()
    holding_row, go = threading.Event(), threading.Event()
    writer, _ = elsewhere(foreign_writer(step, holding_row, go))
    assert holding_row.wait(30)

    def purge() -> str:
        scalar("SELECT set_config('deadlock_timeout', '1s', false)")
        try:
            with transaction.atomic():
                services.purge_community(step.community.id, generation)
        except PurgeDeadlocked:
            return "PurgeDeadlocked"
        return "purged"

    purging, purge_pid = elsewhere(purge)
    wait_until_blocked(purge_pid)
    go.set()
    assert purging.result(timeout=60) == "PurgeDeadlocked"
    writer.result(timeout=60)
    assert remaining(step) == 2


def test_a_holder_stuck_in_holding_past_its_lease_stalls_neither_the_reaper_nor_others(elsewhere):
    # Its block holds the row and the community's shared deletion lock, which the
    # reaper takes too (shared with the block), so the sweep reclaims every other
    # expired lease; once the stuck holder moves on, its finish fails closed and its
    # row is reclaimed by the next sweep.
    step = factories.Step(targets=3)
    factories.committed(step)
    leases = []
    for target in step.targets:
        claimed = services.claim_delivery(step.community.id, target, lease_seconds=1)
        assert claimed is not None
        leases.append(claimed[0])
    stuck = leases[0]
    inside, go = threading.Event(), threading.Event()

    def hold() -> str:
        try:
            with services.holding(stuck) as held:
                inside.set()
                assert go.wait(30)
                held.finish(Outcome.FINISHED)
        except LeaseNotLive:
            return "lost"
        return "finished"

    holder, _ = elsewhere(hold)
    assert inside.wait(30)
    time.sleep(1.2)  # every lease has run out
    assert services.reap_expired_deliveries() == 2
    ids = [lease.delivery_id for lease in leases[1:]]
    others = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert set(others.values_list("status", flat=True)) == {"pending"}
    go.set()
    assert holder.result(timeout=60) == "lost"
    assert services.reap_expired_deliveries() == 1
    row = WorkflowAgentDelivery.objects.get(pk=stuck.delivery_id)
    assert (row.status, row.lease_generation) == ("pending", stuck.generation + 1)
