"""Batch claim and batch finish: many leases per statement, the same rules and the
same results as the single-row operations."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings

from tests.support import factories
from tests.support.locks import wait_until_blocked
from tests.support.races import (
    Session,
    begin,
    commit,
    run_together,
    scalar,
    state,
)
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, ProtocolError
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    Lease,
    LeaseLost,
    Outcome,
    Settled,
)


def backlog(count: int, target: bytes | None = None, owner=None) -> tuple[object, bytes, list]:
    """``count`` deliveries for one target in one community, committed oldest first."""
    owner = owner or factories.community()
    target = target or factories.key32()
    ids = []
    for index in range(count):
        (item,) = factories.committed(factories.Step(owner, [target], step_id=f"s{index}"))
        ids.append(item.id)
    # One test transaction gives every row the same now(): space them out, oldest first.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries AS d SET created_at = now() - make_interval("
            "secs => %s - array_position(%s::uuid[], d.id)) WHERE d.id = ANY(%s::uuid[])",
            [count, ids, ids],
        )
    return owner, target, ids


def test_claim_takes_the_oldest_pending_up_to_the_limit_each_with_its_own_lease(db):
    owner, target, ids = backlog(5)
    services.claim_delivery(owner.id, target, delivery_id=ids[1])
    claimed = services.claim_deliveries(owner.id, target, limit=3, lease_seconds=30)
    assert [record.id for _, record in claimed] == [ids[0], ids[2], ids[3]]
    for lease, record in claimed:
        assert lease == Lease(owner.id, record.id, target, 1, record.lease_until)
        assert record.status is DeliveryStatus.CLAIMED
        assert record.lease_until - record.claimed_at == timedelta(seconds=30)
        assert state(record.id) == {"status": "claimed", "lease_generation": 1}
    assert len({record.claimed_at for _, record in claimed}) == 1
    assert state(ids[4]) == {"status": "pending", "lease_generation": 0}


def test_claim_returns_fewer_than_the_limit_and_then_nothing(db):
    owner, target, _ids = backlog(2)
    assert len(services.claim_deliveries(owner.id, target, limit=10)) == 2
    assert services.claim_deliveries(owner.id, target, limit=10) == []


def test_claim_is_scoped_to_its_community_and_target(db):
    owner, target, ids = backlog(2)
    backlog(2, target=target)  # the same target key in another community
    backlog(2, owner=owner)  # another target of the same community
    claimed = services.claim_deliveries(owner.id, target, limit=10)
    assert sorted(record.id for _, record in claimed) == sorted(ids)


def test_claim_bumps_the_generation_of_a_reaped_row(db):
    owner, target, ids = backlog(1)
    ((first, _),) = services.claim_deliveries(owner.id, target, limit=1)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 s' "
            "WHERE id = %s",
            [ids[0]],
        )
    assert services.reap_expired_deliveries() == 1
    ((again, _),) = services.claim_deliveries(owner.id, target, limit=1)
    assert again.generation == first.generation + 2


@pytest.mark.parametrize("limit", [0, -1, services.MAX_BATCH_SIZE + 1, 1.0, True, "3", None])
def test_claim_refuses_a_bad_limit_and_changes_nothing(db, limit):
    owner, target, ids = backlog(1)
    with pytest.raises(ProtocolError) as caught:
        services.claim_deliveries(owner.id, target, limit=limit)
    assert caught.value.field == "limit"
    assert state(ids[0]) == {"status": "pending", "lease_generation": 0}


def test_claim_refuses_a_bad_lease_length(db):
    owner, target, ids = backlog(1)
    with pytest.raises(ProtocolError) as caught:
        services.claim_deliveries(owner.id, target, limit=1, lease_seconds=0)
    assert caught.value.field == "lease_seconds"
    assert state(ids[0]) == {"status": "pending", "lease_generation": 0}


def test_claim_in_a_fenced_community_is_refused_and_the_callers_transaction_goes_on(db):
    owner, target, ids = backlog(1)
    healthy, healthy_target, healthy_ids = backlog(1)
    services.transition_community(owner.id, "quiescing")
    with transaction.atomic():
        with pytest.raises(CommunityWriteFenced):
            services.claim_deliveries(owner.id, target, limit=5)
        claimed = services.claim_deliveries(healthy.id, healthy_target, limit=5)
    assert [record.id for _, record in claimed] == healthy_ids
    assert state(ids[0]) == {"status": "pending", "lease_generation": 0}


def expire(lease: Lease) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 s' "
            "WHERE id = %s",
            [lease.delivery_id],
        )


def test_finish_gives_every_result_in_input_order(db):
    owner, target, _ids = backlog(6)
    leases = [lease for lease, _ in services.claim_deliveries(owner.id, target, limit=6)]
    done, failed, retried, expired, reaped, stranger = leases
    services.finish_delivery(retried, Outcome.FAILED)
    expire(reaped)
    assert services.reap_expired_deliveries() == 1
    expire(expired)
    # ``reaped`` was returned to pending; a newer holder claims and settles it.
    ((newer, _),) = services.claim_deliveries(owner.id, target, limit=1)
    assert newer.delivery_id == reaped.delivery_id
    services.finish_delivery(newer, Outcome.FINISHED)
    wrong_target = Lease(owner.id, stranger.delivery_id, factories.key32(), 1, stranger.lease_until)
    results = services.finish_deliveries(
        [
            (reaped, Outcome.FINISHED),
            (done, Outcome.FINISHED),
            (wrong_target, Outcome.FINISHED),
            (failed, "failed"),
            (retried, Outcome.FINISHED),
            (expired, Outcome.FINISHED),
            (stranger, Outcome.FAILED),
        ]
    )
    assert results == [
        LeaseLost(),
        Settled(Outcome.FINISHED),
        LeaseLost(),
        Settled(Outcome.FAILED),
        AlreadyTerminal(DeliveryStatus.FAILED),
        LeaseLost(),
        Settled(Outcome.FAILED),
    ]
    assert state(done.delivery_id)["status"] == "finished"
    assert state(failed.delivery_id)["status"] == "failed"
    assert state(retried.delivery_id)["status"] == "failed"
    assert state(expired.delivery_id)["status"] == "claimed"
    assert state(reaped.delivery_id) == {"status": "finished", "lease_generation": 3}
    assert state(stranger.delivery_id)["status"] == "failed"


def test_finish_matches_finish_delivery_pair_by_pair(db):
    owner, target, _ids = backlog(3)
    leases = [lease for lease, _ in services.claim_deliveries(owner.id, target, limit=3)]
    services.finish_delivery(leases[0], Outcome.FINISHED)
    expire(leases[1])
    batch = services.finish_deliveries([(lease, Outcome.FAILED) for lease in leases])
    singles = [services.finish_delivery(lease, Outcome.FAILED) for lease in leases]
    # The batch ran first, so each single call sees what the batch left.
    assert batch == [AlreadyTerminal(DeliveryStatus.FINISHED), LeaseLost(), Settled(Outcome.FAILED)]
    assert singles == [
        AlreadyTerminal(DeliveryStatus.FINISHED),
        LeaseLost(),
        AlreadyTerminal(DeliveryStatus.FAILED),
    ]


def test_a_repeated_lease_settles_once_by_its_first_occurrence(db):
    owner, target, _ids = backlog(2)
    first, second = [lease for lease, _ in services.claim_deliveries(owner.id, target, limit=2)]
    results = services.finish_deliveries(
        [
            (first, Outcome.FAILED),
            (second, Outcome.FINISHED),
            (first, Outcome.FINISHED),
            (first, Outcome.FAILED),
        ]
    )
    assert results == [
        Settled(Outcome.FAILED),
        Settled(Outcome.FINISHED),
        AlreadyTerminal(DeliveryStatus.FAILED),
        AlreadyTerminal(DeliveryStatus.FAILED),
    ]
    assert state(first.delivery_id)["status"] == "failed"


def test_a_repeated_lost_lease_is_lost_every_time(db):
    owner, target, _ids = backlog(1)
    ((lease, _),) = services.claim_deliveries(owner.id, target, limit=1)
    expire(lease)
    assert services.finish_deliveries([(lease, "finished"), (lease, "finished")]) == [
        LeaseLost(),
        LeaseLost(),
    ]


def test_finish_of_nothing_is_nothing(db):
    assert services.finish_deliveries([]) == []


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("not a pair", "settlements"),
        ((None, "finished"), "lease"),
        (("lease", "finished", "extra"), "settlements"),
        ((..., "done"), "outcome"),
    ],
)
def test_finish_refuses_bad_input_and_settles_nothing(db, bad, field):
    owner, target, _ids = backlog(1)
    ((lease, _),) = services.claim_deliveries(owner.id, target, limit=1)
    if isinstance(bad, tuple) and bad[0] is ...:
        bad = (lease, bad[1])
    with pytest.raises(ProtocolError) as caught:
        services.finish_deliveries([(lease, Outcome.FINISHED), bad])
    assert caught.value.field == field
    assert state(lease.delivery_id)["status"] == "claimed"


@pytest.mark.parametrize("bad", ["finished", b"x", 3, None])
def test_finish_refuses_what_is_not_a_list_of_pairs(db, bad):
    with pytest.raises(ProtocolError) as caught:
        services.finish_deliveries(bad)
    assert caught.value.field == "settlements"


def test_finish_refuses_more_than_the_maximum(db):
    owner, target, _ids = backlog(1)
    ((lease, _),) = services.claim_deliveries(owner.id, target, limit=1)
    with pytest.raises(ProtocolError) as caught:
        services.finish_deliveries([(lease, "finished")] * (services.MAX_BATCH_SIZE + 1))
    assert caught.value.field == "settlements"
    assert state(lease.delivery_id)["status"] == "claimed"


def test_finish_in_a_fenced_community_is_refused_and_changes_nothing(db):
    owner, target, _ids = backlog(1)
    healthy, healthy_target, _ = backlog(1)
    ((lease, _),) = services.claim_deliveries(owner.id, target, limit=1)
    ((other, _),) = services.claim_deliveries(healthy.id, healthy_target, limit=1)
    services.transition_community(owner.id, "quiescing")
    with pytest.raises(CommunityWriteFenced):
        services.finish_deliveries([(other, "finished"), (lease, "finished")])
    assert state(lease.delivery_id)["status"] == "claimed"
    assert state(other.delivery_id)["status"] == "claimed"


# --- two connections at once ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_connections_batch_claiming_never_get_the_same_row():
    owner, target, ids = backlog(60)
    claimed: list[list[uuid.UUID]] = [[], []]
    lock = threading.Lock()

    def claimer(index: int) -> None:
        while True:
            batch = services.claim_deliveries(owner.id, target, limit=7)
            if not batch:
                return
            with lock:
                claimed[index] += [record.id for _, record in batch]
            leases = [(lease, Outcome.FINISHED) for lease, _ in batch]
            assert services.finish_deliveries(leases) == [Settled(Outcome.FINISHED)] * len(batch)

    run_together(2, claimer)
    assert not set(claimed[0]) & set(claimed[1])
    assert sorted(claimed[0] + claimed[1]) == sorted(ids)


@pytest.mark.django_db(transaction=True)
def test_a_claim_skips_rows_another_claim_holds_locked():
    owner, target, ids = backlog(4)
    other = Session()
    try:
        other.call(begin)
        held = other.call(lambda: services.claim_deliveries(owner.id, target, limit=2))
        mine = services.claim_deliveries(owner.id, target, limit=4)
        other.call(commit)
    finally:
        other.close()
    assert [record.id for _, record in held] == ids[:2]
    assert [record.id for _, record in mine] == ids[2:]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("finish", ["single", "batch"])
def test_a_retry_racing_its_own_settle_reports_the_recorded_status(finish):
    """Behind a concurrent settle of the same lease, the retry waits for the row lock and
    then sees the settle: already terminal, by either entry point."""
    owner, target, _ids = backlog(1)
    ((lease, _),) = services.claim_deliveries(owner.id, target, limit=1)
    first, retry = Session(), Session()
    try:
        first.call(begin)
        assert first.call(services.finish_delivery, lease, Outcome.FINISHED) == Settled(
            Outcome.FINISHED
        )
        pid = retry.call(scalar, "SELECT pg_backend_pid()")
        if finish == "single":
            pending = retry.submit(services.finish_delivery, lease, Outcome.FAILED)
        else:
            pending = retry.submit(services.finish_deliveries, [(lease, Outcome.FAILED)])
        wait_until_blocked(pid)
        first.call(commit)
        result = pending.result(timeout=30)
    finally:
        first.close()
        retry.close()
    expected = AlreadyTerminal(DeliveryStatus.FINISHED)
    assert result == (expected if finish == "single" else [expected])
    assert state(lease.delivery_id)["status"] == "finished"


@pytest.mark.parametrize("prepared", [True, False])
def test_batch_works_prepared_and_through_djangos_cursor(db, prepared):
    owner, target, ids = backlog(3)
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared):
        claimed = services.claim_deliveries(owner.id, target, limit=3)
        settled = services.finish_deliveries([(lease, "finished") for lease, _ in claimed])
        retried = services.finish_deliveries([(lease, "failed") for lease, _ in claimed])
    assert [record.id for _, record in claimed] == ids
    assert settled == [Settled(Outcome.FINISHED)] * 3
    assert retried == [AlreadyTerminal(DeliveryStatus.FINISHED)] * 3
