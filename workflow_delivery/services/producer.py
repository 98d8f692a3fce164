"""The producer's side: commit one step's deliveries under the step's identity lock,
once however often the step is retried, waking the consumers registered idle on
their targets.

``send_message`` (``services.sending``) is the one-call producer built on these."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, DatabaseError, transaction

from ..conf import app_settings
from ..exceptions import BindingScopeError, ProtocolError, StepIdentityClosed
from ..protocol import NewDelivery, as_datetime, as_step_id, as_uuid
from ..store import rows, run, statements
from ..store.statement import Statement

logger = logging.getLogger(__name__)


def _new_deliveries(deliveries: object) -> list[NewDelivery]:
    if isinstance(deliveries, NewDelivery | str | bytes) or not isinstance(deliveries, Iterable):
        raise ProtocolError("deliveries", "must be a list of NewDelivery")
    batch = list(deliveries)
    if not batch:
        raise ProtocolError("deliveries", "a step commits at least one delivery")
    for item in batch:
        if not isinstance(item, NewDelivery):
            raise ProtocolError("deliveries", f"must hold NewDelivery, not {type(item).__name__}")
    return batch


def _insert_deliveries(
    insert: Statement, params: dict[str, object], using: str, *, savepoint: bool = True
) -> list[UUID]:
    """Run a delivery insert (rows: id, community_id, target_pubkey) and return the
    created ids. With ``WORKFLOW_DELIVERY_NOTIFY`` on (the default) it wakes the
    consumers registered idle on the created rows' targets (``register_idle``), one
    notification per target, and consumes their registrations; targets nobody waits
    on cost one probe of the small idle registry and send nothing.

    By default (``WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION``) the insert itself does it
    (``statements.notifying``), so the wake-ups are part of the commit. Turned off, they go
    out right after the transaction commits, in a statement of their own
    (``on_commit``; a rollback drops them), and a producer that dies in between sends
    none."""
    in_statement = app_settings.NOTIFY and app_settings.NOTIFY_IN_TRANSACTION
    statement = statements.notifying(insert) if in_statement else insert
    created = run.fetch(using, statement, params, savepoint=savepoint)
    if created and app_settings.NOTIFY and not in_statement:
        wake = {
            "ids": [row[0] for row in created],
            "community_ids": [row[1] for row in created],
            "target_pubkeys": [bytes(row[2]) for row in created],
        }
        transaction.on_commit(partial(_wake_idle, wake, using), using=using)
    return [row[0] for row in created]


def _wake_idle(created: dict[str, list[object]], using: str) -> None:
    # After the commit, in a transaction of its own that does not wait for its WAL
    # flush (see statements.WAKE_IDLE_AFTER_COMMIT). The deliveries are committed whatever
    # happens here; a wake-up lost to an error is what polling is for, so it is
    # logged, never raised to the producer.
    try:
        run.fetch(using, statements.WAKE_IDLE_AFTER_COMMIT, created)
    except DatabaseError:
        logger.warning(
            "wake-ups for %s deliveries were not sent", len(created["ids"]), exc_info=True
        )


class StepIdentity:
    """The producer's hold on one (community, run, step) inside its transaction."""

    def __init__(
        self, community_id: UUID, run_id: UUID, step_id: str, exists: bool, using: str
    ) -> None:
        self.community_id = community_id
        self.run_id = run_id
        self.step_id = step_id
        self.exists = exists
        self._using = using
        self._open = True

    def __repr__(self) -> str:
        return (
            f"StepIdentity(community_id={self.community_id}, run_id={self.run_id}, "
            f"step_id={self.step_id!r}, exists={self.exists})"
        )

    def _validate(self, batch: list[NewDelivery]) -> bool:
        """Check a step's batch; True when every delivery shares all of the first's
        binding but its target (the usual step)."""
        ids, targets = set(), set()
        first = batch[0].binding
        shared = True
        for item in batch:
            binding = item.binding
            if binding.community_id != self.community_id:
                raise BindingScopeError(
                    "community_id",
                    f"delivery {item.id} belongs to community {binding.community_id}, "
                    f"not the committing community {self.community_id}",
                )
            if binding.run_id != self.run_id or binding.step_id != self.step_id:
                raise BindingScopeError(
                    "step_id",
                    f"delivery {item.id} is for run {binding.run_id} step {binding.step_id!r}; "
                    f"this commit is for run {self.run_id} step {self.step_id!r} "
                    "(deliveries of several steps cannot share one commit)",
                )
            if binding.message_event_id != first.message_event_id:
                raise ProtocolError(
                    "message_event_id", "every delivery of a step carries the same message event"
                )
            if shared and (
                binding.workflow_id != first.workflow_id
                or binding.definition_event_id != first.definition_event_id
                or binding.cause != first.cause
            ):
                shared = False
            if item.id in ids:
                raise ProtocolError("id", f"delivery id {item.id} appears twice in one commit")
            if binding.target_pubkey in targets:
                raise ProtocolError(
                    "target_pubkey",
                    f"target {binding.target_pubkey.hex()} appears twice in one commit",
                )
            ids.add(item.id)
            targets.add(binding.target_pubkey)
        return shared

    def _values(
        self, message_event_created_at: datetime, batch: list[NewDelivery]
    ) -> tuple[bool, dict[str, object]]:
        """The insert's row parameters (by column) for a batch checked by
        ``_new_deliveries``, and whether they are for the shared form (the first
        binding's shared columns as values, the ids and the targets as arrays) or one
        array per column (``statements.INSERT_TYPES``, unnested into rows, in order)."""
        created_at = as_datetime("message_event_created_at", message_event_created_at)
        columns = list(statements.INSERT_TYPES)
        shared = self._validate(batch)
        values = []
        for item in batch[:1] if shared else batch:
            b = item.binding
            values.append(
                [
                    item.id,
                    b.community_id,
                    b.workflow_id,
                    b.run_id,
                    b.step_id,
                    b.target_pubkey,
                    b.definition_event_id,
                    b.message_event_id,
                    created_at,
                    *rows.cause_columns(b),
                ]
            )
        if not shared:
            return False, {
                name: list(column)
                for name, column in zip(columns, zip(*values, strict=True), strict=True)
            }
        params = dict(zip(columns, values[0], strict=True))
        params["id"] = [item.id for item in batch]
        params["target_pubkey"] = [item.binding.target_pubkey for item in batch]
        return True, params

    def commit(
        self, message_event_created_at: datetime, deliveries: Iterable[NewDelivery]
    ) -> list[UUID]:
        """Insert the step's deliveries at once; return the ids actually created.
        An existing (community, run, step, target) is skipped, so a retry creates nothing.
        A message other than the one the step's deliveries carry is refused
        (``StepMessageConflict``) and nothing is written."""
        if not self._open:
            # After the block the identity lock is released (and the transaction may
            # be autocommit): an insert now would skip the very check the lock gives.
            raise StepIdentityClosed(
                f"{self!r}: its delivery_identity block has closed; commit inside the block"
            )
        shared, params = self._values(message_event_created_at, _new_deliveries(deliveries))
        insert = statements.INSERT_SHARED_DELIVERIES if shared else statements.INSERT_DELIVERIES
        params["community"] = self.community_id
        created = _insert_deliveries(insert, params, self._using, savepoint=False)
        if created:
            self.exists = True
        return created


@contextmanager
def delivery_identity(
    community_id: UUID | str,
    run_id: UUID | str,
    step_id: str,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> Iterator[StepIdentity]:
    """Open a transaction holding the step's identity lock. ``.exists`` tells whether
    the step already has deliveries (reuse the signed message); ``.commit`` inserts
    them. The producer's own writes in the block commit or roll back with them."""
    step_id = as_step_id(step_id)
    community_id = as_uuid("community_id", community_id)
    run_id = as_uuid("run_id", run_id)
    with transaction.atomic(using=using):
        step = {"community": community_id, "run": run_id, "step": step_id}
        # Transaction-scoped: released by our commit or rollback, never leaked.
        run.fetch(using, statements.LOCK_STEP_IDENTITY, step, savepoint=False)
        exists = bool(run.fetch(using, statements.STEP_EXISTS, step, savepoint=False)[0][0])
        identity = StepIdentity(community_id, run_id, step_id, exists, using)
        try:
            yield identity
        finally:
            identity._open = False


def commit_deliveries(
    community_id: UUID | str,
    message_event_created_at: datetime,
    deliveries: Iterable[NewDelivery],
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Commit the deliveries of one (run, step) in one call; returns the ids created."""
    batch = _new_deliveries(deliveries)
    first = batch[0].binding
    identity = StepIdentity(
        as_uuid("community_id", community_id), first.run_id, first.step_id, False, using
    )
    shared, params = identity._values(message_event_created_at, batch)
    params.update(community=identity.community_id, run=identity.run_id, step=identity.step_id)
    # One statement takes the step's identity lock and inserts every row: in
    # autocommit it is its own transaction (all rows or none), else the caller's.
    if shared:
        insert = statements.LOCK_AND_INSERT_SHARED_DELIVERIES
    else:
        insert = statements.LOCK_AND_INSERT_DELIVERIES
    return _insert_deliveries(insert, params, using)
