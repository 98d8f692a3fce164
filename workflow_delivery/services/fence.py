"""The community lifecycle and the deletion executor's side of the write fence.

Writers pass the fence under the *shared* advisory lock on the community's
deletion key (the row trigger takes it). The executor takes the *exclusive* lock,
so it waits for every writer already past the fence and holds new ones until it
commits; then it may write or purge the tenant's rows by presenting, for its
transaction only, the community and the current fence generation. The database
records the presentation only for a role allowed to execute ``wd_present_executor``
(the migrating role, or one granted it): an app role that takes the lock and sets
the settings itself is still refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, DatabaseError, OperationalError, connections, transaction

from ..conf import app_settings
from ..errors import sqlstate
from ..exceptions import (
    CommunityNotFound,
    ExecutorNotAuthorized,
    InvalidLifecycleTransition,
    ProtocolError,
    PurgeDeadlocked,
    StaleFenceGeneration,
    UnexpectedCommunityState,
)
from ..models import DeletionState
from ..protocol import as_uuid
from ..store import django_adapter, run, statements
from ..store.errors import database_errors
from ..validation import checked_batch_seconds, checked_batch_size

__all__ = [
    "PURGE_ATTEMPTS",
    "begin_deletion",
    "community_write_allowed",
    "executor_writes",
    "purge_community",
    "transition_community",
]


def _state(value: str) -> DeletionState:
    try:
        return DeletionState(value)
    except ValueError:
        raise ProtocolError(
            "deletion_state", f"{value!r} is not one of {', '.join(DeletionState.values)}"
        ) from None


def _lock_exclusive(using: str, community_id: UUID) -> tuple[DeletionState, int]:
    community = {"community_id": str(community_id)}
    run.fetch(using, statements.REQUIRE_READ_COMMITTED, savepoint=False)
    run.fetch(using, statements.LOCK_COMMUNITY_EXCLUSIVE, community, savepoint=False)
    rows = run.fetch(using, statements.COMMUNITY_FENCE_STATE, community, savepoint=False)
    if not rows:
        raise CommunityNotFound(f"community {community_id} does not exist")
    ((state, generation),) = rows
    return DeletionState(state), generation


def transition_community(
    community_id: UUID | str,
    to_state: str,
    *,
    expected: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Move a community one step through ``active → quiescing → fenced → tombstone``
    as the deletion executor and return the new fence generation. A quiescing
    community may return to active (deletion cancelled); a tombstone is permanent.
    The database's lifecycle trigger is the judge; a move it refuses (a skipped step
    included) raises InvalidLifecycleTransition.

    ``expected`` is the state the caller read: checked under the exclusive lock, so
    a community moved by someone else since is not moved on from a state the caller
    never saw (``UnexpectedCommunityState``, nothing changed)."""
    community_id = as_uuid("community_id", community_id)
    target = _state(to_state)
    source = None if expected is None else _state(expected)
    with transaction.atomic(using=using), database_errors():
        current, generation = _lock_exclusive(using, community_id)
        if source is not None and current != source:
            raise UnexpectedCommunityState(
                f"community {community_id} is {current}, not {source} as expected: "
                f"not moved to {target}"
            )
        if current == target:
            return generation
        moved = {"state": target.value, "community_id": str(community_id)}
        return run.fetch(using, statements.SET_COMMUNITY_STATE, moved, savepoint=False)[0][0]


def begin_deletion(community_id: UUID | str, *, using: str = DEFAULT_DB_ALIAS) -> int:
    return transition_community(community_id, DeletionState.QUIESCING, using=using)


@contextmanager
def executor_writes(
    community_id: UUID | str, generation: int, *, using: str = DEFAULT_DB_ALIAS
) -> Iterator[DeletionState]:
    """Inside this block (one transaction), the executor may write or purge the rows
    of a community that is not active, presenting ``generation``; the block gets the
    community's state. A generation that is no longer current raises
    ``StaleFenceGeneration`` and nothing is written."""
    community_id = as_uuid("community_id", community_id)
    with transaction.atomic(using=using):
        # Only the lock is translated: the block's own errors reach it unchanged.
        state, current = _lock_exclusive(using, community_id)
        if current != generation:
            raise StaleFenceGeneration(
                f"community {community_id}: fence generation {generation} is stale "
                f"(current is {current})"
            )
        _present(community_id, generation, using)
        yield state
        # The presentation is transaction-local: an error rolls it back with the
        # block; on success clear it so an enclosing transaction keeps no authority.
        run.fetch(using, statements.WITHDRAW_EXECUTOR, savepoint=False)


def _present(community_id: UUID, generation: int, using: str) -> None:
    executor = {"community_id": str(community_id), "generation": generation}
    try:
        # Under a savepoint, so the refusal can still name the role.
        run.fetch(using, statements.PRESENT_EXECUTOR, executor)
    except DatabaseError as exc:
        if sqlstate(exc) != "42501":  # insufficient_privilege
            raise
        ((role,),) = run.fetch(using, statements.CURRENT_ROLE, savepoint=False)
        raise ExecutorNotAuthorized(
            f"role {role} may not act as the deletion executor of community "
            f"{community_id}: it needs EXECUTE on wd_present_executor (an executor role)"
        ) from exc


# Tries of a purge that a deadlock chose as its victim.
PURGE_ATTEMPTS = 3


def purge_community(
    community_id: UUID | str,
    generation: int,
    *,
    batch_size: int | None = None,
    batch_seconds: float | None = None,
    progress: Callable[[dict[str, int]], None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, int]:
    """Delete every tenant row of a community that is not active, as the executor.
    Returns the number of rows deleted per table.

    The rows go in batches of at most ``batch_size`` (``WORKFLOW_DELIVERY_PURGE_BATCH_SIZE``),
    each in a transaction of its own that holds the community's exclusive deletion
    lock only while it deletes them: between two, the lock is free, and the
    community's requests and lifecycle wait for one batch at most. The batch's size
    follows its time: the first holds at most ``FIRST_PURGE_BATCH`` rows; one that
    took longer than ``batch_seconds`` (``WORKFLOW_DELIVERY_PURGE_BATCH_SECONDS``) makes
    the next smaller in proportion, one that took under half of it makes the next
    twice as large, up to ``batch_size``; so a slow server (a busy one, or rows whose
    deletion costs more) still holds the lock about ``batch_seconds`` at a time. With
    ``batch_seconds`` 0 every batch holds ``batch_size`` rows. ``progress`` is
    called after each batch with the totals so far. A purge interrupted midway
    keeps the batches it committed; called again, it deletes what is left. Inside
    the caller's transaction the batches are part of it (and the lock held to its
    end).

    The app's own writers take the community's deletion lock before its rows, as the
    purge does, so they never deadlock with it. A writer outside the app (raw SQL, an
    ORM write of a run) takes a row first and the lock in the fence trigger; a batch
    that deadlock detection chose as the victim rolls back and, in a transaction of
    its own, tries again, up to ``PURGE_ATTEMPTS`` times in all. A purge inside the
    caller's transaction cannot try again. Either way the caller gets
    ``PurgeDeadlocked``, never the driver's error."""
    community_id = as_uuid("community_id", community_id)
    most = checked_batch_size(batch_size, app_settings.PURGE_BATCH_SIZE)
    target = checked_batch_seconds(batch_seconds, app_settings.PURGE_BATCH_SECONDS)
    size = most if not target else min(most, FIRST_PURGE_BATCH)
    attempts = 1 if django_adapter.in_transaction(connections[using]) else PURGE_ATTEMPTS
    deleted = {table: 0 for table, _ in statements.PURGE}
    while True:
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                batch = _purge_batch(community_id, generation, size, using)
                break
            except OperationalError as exc:
                if sqlstate(exc) != "40P01":  # deadlock_detected
                    raise
                if attempt >= attempts:
                    raise PurgeDeadlocked(
                        f"community {community_id}: a batch of the purge was a deadlock's "
                        f"victim {attempt} time(s); the batches before it are deleted"
                    ) from exc
        held = time.monotonic() - started
        for table, count in batch.items():
            deleted[table] += count
        if not any(batch.values()):
            return deleted
        if target:
            size = _next_batch_size(size, most, held, target)
        if progress is not None:
            progress(dict(deleted))


# Rows the first batch of a purge that follows its time deletes at most.
FIRST_PURGE_BATCH = 100


def _next_batch_size(size: int, most: int, held: float, target: float) -> int:
    """The next batch's size after one of ``size`` rows took ``held`` seconds."""
    if held > target:
        return max(1, int(size * target / held))
    if held < target / 2:
        return min(most, size * 2)
    return size


def _purge_batch(community_id: UUID, generation: int, size: int, using: str) -> dict[str, int]:
    """At most ``size`` of the community's rows, deleted in one transaction of the
    executor: each table's in turn, a table only once those before it are empty."""
    deleted: dict[str, int] = {}
    budget = size
    with executor_writes(community_id, generation, using=using) as state:
        if state == DeletionState.ACTIVE:
            raise InvalidLifecycleTransition(
                f"community {community_id} is active: begin its deletion before purging"
            )
        for table, purge in statements.PURGE:
            if budget == 0:
                break
            batch = {"community_id": str(community_id), "limit": budget}
            count = deleted[table] = run.fetch_count(using, purge, batch, savepoint=False)
            if count == budget:
                # The table may hold more: the next batch starts over from the first.
                break
            budget -= count
    return deleted


def community_write_allowed(community_id: UUID | str, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """The database's own verdict: true only for an existing, active community."""
    community_id = as_uuid("community_id", community_id)
    with transaction.atomic(using=using):
        community = {"community_id": str(community_id)}
        allowed = run.fetch(using, statements.COMMUNITY_WRITE_ALLOWED, community, savepoint=False)
        return bool(allowed[0][0])
