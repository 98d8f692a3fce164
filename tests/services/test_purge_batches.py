"""A community's purge deletes its rows in batches, each a transaction of its own that
holds the exclusive deletion lock only while it deletes them: between two batches
another session takes the lock, and a purge interrupted midway keeps what it
committed and, called again, deletes the rest."""

from __future__ import annotations

import itertools

import pytest

from tests.support import factories
from tests.support.locks import key_of
from tests.support.second_session import other
from workflow_delivery import services
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.services.fence import FIRST_PURGE_BATCH
from workflow_delivery.store import statements

pytestmark = pytest.mark.django_db(transaction=True)

TABLES = [table for table, _ in statements.PURGE]


def fenced_community(steps: int = 3, targets: int = 3):
    """A fenced community with ``steps`` steps of ``targets`` deliveries each (their
    runs, events, timeline and roster rows too); its id and fence generation."""
    owner = factories.community()
    for _ in range(steps):
        factories.committed(factories.Step(owner=owner, targets=targets))
    return owner.id, factories.move_to(owner.id, "fenced")


def rows_left(session, community_id) -> dict[str, int]:
    """The community's committed rows per table, as another session sees them."""
    counts = {}
    for table in TABLES:
        counts[table] = session.execute(
            f'SELECT count(*) FROM "{table}" WHERE community_id = %s', [community_id]
        ).fetchone()[0]
    session.rollback()
    return counts


def test_between_batches_the_lock_is_free_and_the_deletions_committed():
    community_id, generation = fenced_community()
    key = key_of(community_id)
    seen = []
    with other() as session:
        before = rows_left(session, community_id)

        def between(totals: dict[str, int]) -> None:
            # Exclusive: granted only when the purge holds no lock of the community.
            (taken,) = session.execute("SELECT pg_try_advisory_xact_lock(%s)", [key]).fetchone()
            session.rollback()
            left = rows_left(session, community_id)
            seen.append((taken, sum(left.values()), sum(totals.values())))

        deleted = services.purge_community(
            community_id, generation, batch_size=4, batch_seconds=0, progress=between
        )
        assert rows_left(session, community_id) == dict.fromkeys(TABLES, 0)
    total = sum(before.values())
    assert deleted == before and total > 8
    assert len(seen) == -(-total // 4)  # one call per batch that deleted something
    assert all(taken for taken, _, _ in seen)
    # What another session sees committed after each batch: 4 rows fewer each time.
    assert [left for _, left, _ in seen] == [total - done for _, _, done in seen]
    assert [done for _, _, done in seen] == [min(4 * n, total) for n in range(1, len(seen) + 1)]


class Interrupted(Exception):
    pass


def test_a_purge_interrupted_midway_keeps_its_batches_and_resumes():
    community_id, generation = fenced_community()

    def stop(totals: dict[str, int]) -> None:
        raise Interrupted(totals)

    with other() as session:
        before = rows_left(session, community_id)
        with pytest.raises(Interrupted) as caught:
            services.purge_community(
                community_id, generation, batch_size=5, batch_seconds=0, progress=stop
            )
        (first,) = caught.value.args
        assert sum(first.values()) == 5
        left = rows_left(session, community_id)
        assert {table: before[table] - left[table] for table in TABLES} == first
        rest = services.purge_community(community_id, generation, batch_size=5, batch_seconds=0)
        assert rows_left(session, community_id) == dict.fromkeys(TABLES, 0)
    assert {table: first[table] + rest[table] for table in TABLES} == before


@pytest.mark.parametrize("size", [0, -1, True, 2.5])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_refused(size):
    community_id, generation = fenced_community(steps=1, targets=1)
    with pytest.raises(ProtocolError, match="batch_size"):
        services.purge_community(community_id, generation, batch_size=size)


def batch_sizes(community_id, generation, **options) -> list[int]:
    """The rows each batch of a purge deleted."""
    totals: list[int] = [0]

    def seen(deleted: dict[str, int]) -> None:
        totals.append(sum(deleted.values()))

    services.purge_community(community_id, generation, progress=seen, **options)
    return [after - before for before, after in itertools.pairwise(totals)]


def test_a_batch_over_its_time_makes_the_next_smaller():
    community_id, generation = fenced_community()
    # Every batch takes longer than a microsecond: each next one is cut to one row.
    sizes = batch_sizes(community_id, generation, batch_size=10, batch_seconds=1e-6)
    assert sizes[0] == 10 and len(sizes) > 2
    assert set(sizes[1:]) == {1}


def test_a_quick_batch_makes_the_next_larger_up_to_the_batch_size():
    community_id, generation = fenced_community(steps=20, targets=10)
    most = FIRST_PURGE_BATCH + FIRST_PURGE_BATCH // 2
    sizes = batch_sizes(community_id, generation, batch_size=most, batch_seconds=3600)
    # The first batch holds FIRST_PURGE_BATCH rows; the next would double, but no batch
    # holds more than the batch size.
    assert sum(sizes) > FIRST_PURGE_BATCH + 2 * most
    assert sizes[:3] == [FIRST_PURGE_BATCH, most, most]


@pytest.mark.parametrize("seconds", [-1, "0.2", float("inf"), True])
def test_batch_seconds_that_are_not_a_number_of_seconds_are_refused(seconds):
    community_id, generation = fenced_community(steps=1, targets=1)
    with pytest.raises(ProtocolError, match="batch_seconds"):
        services.purge_community(community_id, generation, batch_seconds=seconds)
