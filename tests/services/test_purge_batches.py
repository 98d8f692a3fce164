"""A community's purge deletes its rows in batches, each a transaction of its own that
holds the exclusive deletion lock only while it deletes them: between two batches
another session takes the lock, and a purge interrupted midway keeps what it
committed and, called again, deletes the rest."""

from __future__ import annotations

import pytest

from tests.support import factories
from tests.support.locks import key_of
from tests.support.second_session import other
from workflow_delivery import fence
from workflow_delivery.exceptions import ProtocolError
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

        deleted = fence.purge_community(community_id, generation, batch_size=4, progress=between)
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
            fence.purge_community(community_id, generation, batch_size=5, progress=stop)
        (first,) = caught.value.args
        assert sum(first.values()) == 5
        left = rows_left(session, community_id)
        assert {table: before[table] - left[table] for table in TABLES} == first
        rest = fence.purge_community(community_id, generation, batch_size=5)
        assert rows_left(session, community_id) == dict.fromkeys(TABLES, 0)
    assert {table: first[table] + rest[table] for table in TABLES} == before


@pytest.mark.parametrize("size", [0, -1, True, 2.5])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_refused(size):
    community_id, generation = fenced_community(steps=1, targets=1)
    with pytest.raises(ProtocolError, match="batch_size"):
        fence.purge_community(community_id, generation, batch_size=size)
