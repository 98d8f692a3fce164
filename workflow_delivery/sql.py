"""Every raw statement of the app, named, in one place.

Only what the ORM cannot say lives here: ``UPDATE … RETURNING`` with database-clock
arithmetic, ``INSERT … ON CONFLICT``, advisory locks and transaction-local settings.
Identifiers come from model ``_meta`` through ``quote_name``; values are always
parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from django.db import Error as DatabaseError
from django.db import connection

from .exceptions import (
    CommunityWriteFenced,
    ConstraintViolation,
    DeliveryConflict,
    InvalidLifecycleTransition,
    IsolationLevelError,
    ReferenceMissing,
)
from .models import Community, Event, Workflow, WorkflowAgentDelivery, WorkflowRun

_q = connection.ops.quote_name

DELIVERIES = _q(WorkflowAgentDelivery._meta.db_table)
COMMUNITIES = _q(Community._meta.db_table)

# Columns of a delivery record, in the order ``db.record`` reads them.
RECORD_COLUMNS = [
    "id",
    "community_id",
    "workflow_id",
    "run_id",
    "step_id",
    "target_pubkey",
    "definition_event_id",
    "message_event_id",
    "message_event_created_at",
    "cause_kind",
    "cause_event_id",
    "cause_scheduled_for",
    "cause_webhook_invocation_id",
    "status",
    "lease_generation",
    "lease_until",
    "claimed_at",
    "finished_at",
    "created_at",
]
_RETURNING = ", ".join(f"d.{_q(column)}" for column in RECORD_COLUMNS)
# The columns a producer writes, the first of the record's, with their types.
_WRITTEN_TYPES = ["uuid", "uuid", "uuid", "uuid", "text", "bytea", "bytea", "bytea"]
_WRITTEN_TYPES += ["timestamptz", "text", "bytea", "timestamptz", "uuid"]
_INSERT_TYPES = dict(zip(RECORD_COLUMNS[: len(_WRITTEN_TYPES)], _WRITTEN_TYPES, strict=True))
_INSERT_COLUMNS = ", ".join(_q(column) for column in _INSERT_TYPES)
# Typed placeholders: a VALUES list feeding INSERT … SELECT has no target to infer from.
_INSERT_ROW = "(" + ", ".join(f"%s::{kind}" for kind in _INSERT_TYPES.values()) + ")"

# Identity lock of one (community, run, step): producers of the same step queue
# here, so the "already exists?" answer stays true until the commit lands.
LOCK_STEP_IDENTITY = """
SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %s || ':' || %s || ':' || %s, 0))
"""

# Asked in its own statement once the lock is held: a statement sees only what was
# committed when it began, so the locking statement would miss the commit of the
# producer it waited for.
STEP_EXISTS = f"""
SELECT EXISTS (
    SELECT 1 FROM {DELIVERIES} WHERE community_id = %s AND run_id = %s AND step_id = %s
)
"""


_ON_CONFLICT = "ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id"


@lru_cache(maxsize=64)
def insert_deliveries(count: int) -> str:
    """One multi-row insert of ``count`` deliveries; an existing identity is skipped."""
    rows = ", ".join([_INSERT_ROW] * count)
    return f"INSERT INTO {DELIVERIES} ({_INSERT_COLUMNS}) VALUES {rows} {_ON_CONFLICT}"


@lru_cache(maxsize=64)
def lock_and_insert_deliveries(count: int) -> str:
    """The step's identity lock and the insert of its ``count`` deliveries in one
    statement, for a producer that does not ask whether the step exists. The lock's
    CTE is scanned before any row is produced, so no row is written without it."""
    rows = ", ".join([_INSERT_ROW] * count)
    return f"""
WITH step_lock AS MATERIALIZED ({LOCK_STEP_IDENTITY.strip()}::text AS locked)
INSERT INTO {DELIVERIES} ({_INSERT_COLUMNS})
SELECT v.* FROM (VALUES {rows}) AS v ({_INSERT_COLUMNS}) CROSS JOIN step_lock
{_ON_CONFLICT}
"""


def claim_statement(select_sql: str) -> str:
    """Turn the claim queryset's locking ``SELECT id … FOR UPDATE SKIP LOCKED`` into
    one statement that also marks the winner claimed and returns it."""
    return f"""
WITH picked AS ({select_sql})
UPDATE {DELIVERIES} AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = now(),
       lease_until = now() + make_interval(secs => %s)
  FROM picked
 WHERE d.id = picked.id
RETURNING {_RETURNING}
"""


# Back to pending with the fence bumped, so the holder's lease is dead (reap, release).
_BACK_TO_PENDING = (
    "status = 'pending', lease_generation = d.lease_generation + 1, "
    "lease_until = NULL, claimed_at = NULL"
)
# The lease fields a terminal row gives up (finish, operator mark failed).
_SETTLE = "finished_at = now(), lease_until = NULL, claimed_at = NULL"

# The four conditions of a live lease: claimed, same generation, same target, not expired.
_LIVE_LEASE = """
  community_id = %s AND id = %s AND target_pubkey = %s AND lease_generation = %s
  AND status = 'claimed' AND lease_until >= now()
"""

RENEW = f"""
UPDATE {DELIVERIES}
   SET lease_until = now() + make_interval(secs => %s)
 WHERE {_LIVE_LEASE}
RETURNING lease_until
"""

FINISH = f"""
UPDATE {DELIVERIES}
   SET status = %s, {_SETTLE}
 WHERE {_LIVE_LEASE}
RETURNING status
"""

# After a finish that settled nothing: the row as the caller's full capability sees it.
STATUS_BY_CAPABILITY = f"""
SELECT status FROM {DELIVERIES}
 WHERE community_id = %s AND id = %s AND target_pubkey = %s AND lease_generation = %s
"""

# One bounded batch of the fleet-wide reaper. A tenant that is not active is
# filtered out inside the statement, so its fence never aborts the sweep; rows a
# live holder has locked are skipped, not waited for.
REAP_BATCH = f"""
WITH expired AS (
    SELECT id FROM {DELIVERIES}
     WHERE status = 'claimed' AND lease_until < now()
       AND community_write_allowed(community_id)
     ORDER BY lease_until
     LIMIT %s
     FOR UPDATE SKIP LOCKED
)
UPDATE {DELIVERIES} AS d
   SET {_BACK_TO_PENDING}
  FROM expired
 WHERE d.id = expired.id
RETURNING d.community_id
"""

# An operator's release of chosen claimed rows (admin): back to pending, fence bumped.
RELEASE = f"""
UPDATE {DELIVERIES} AS d
   SET {_BACK_TO_PENDING}
 WHERE d.community_id = %s AND d.id = ANY(%s) AND d.status = 'claimed'
   AND community_write_allowed(d.community_id)
RETURNING d.id
"""

# An operator's terminal for chosen non-terminal rows (admin), recorded as failed.
MARK_FAILED = f"""
UPDATE {DELIVERIES} AS d
   SET status = 'failed', {_SETTLE}
 WHERE d.community_id = %s AND d.id = ANY(%s) AND d.status IN ('pending', 'claimed')
   AND community_write_allowed(d.community_id)
RETURNING d.id
"""

# The fence's own rule, from migration 0003: READ COMMITTED or a clear error.
REQUIRE_READ_COMMITTED = "SELECT wd_require_read_committed()"

COMMUNITY_WRITE_ALLOWED = "SELECT community_write_allowed(%s::uuid)"

# The executor's exclusive deletion lock: waits for writers already past the
# fence (they hold the shared lock until commit) and holds back new ones.
LOCK_COMMUNITY_EXCLUSIVE = "SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s::uuid))"

COMMUNITY_FENCE_STATE = f"""
SELECT deletion_state, deletion_fence_generation FROM {COMMUNITIES} WHERE id = %s
   FOR NO KEY UPDATE
"""

SET_COMMUNITY_STATE = f"""
UPDATE {COMMUNITIES} SET deletion_state = %s WHERE id = %s RETURNING deletion_fence_generation
"""

PRESENT_EXECUTOR = """
SELECT set_config('workflow_delivery.executor_community', %s, true),
       set_config('workflow_delivery.executor_generation', %s, true)
"""

WITHDRAW_EXECUTOR = """
SELECT set_config('workflow_delivery.executor_community', '', true),
       set_config('workflow_delivery.executor_generation', '', true)
"""

# Children first, so no foreign key refuses the purge.
PURGE_ORDER = [
    WorkflowAgentDelivery._meta.db_table,
    WorkflowRun._meta.db_table,
    Workflow._meta.db_table,
    Event._meta.db_table,
]


def purge_statement(table: str) -> str:
    return f"DELETE FROM {_q(table)} WHERE community_id = %s"


_REFERENCE_CONSTRAINTS = {
    "wd_delivery_community_fk": "community",
    "wd_delivery_workflow_fk": "workflow",
    "wd_delivery_run_fk": "run (of that workflow)",
    "wd_delivery_message_event_fk": "message event (at that created_at)",
}
_LIFECYCLE_CONSTRAINTS = {"wd_community_lifecycle_forward", "wd_community_tombstone_permanent"}
_DELIVERY_PRIMARY_KEY = f"{WorkflowAgentDelivery._meta.db_table}_pkey"


@contextmanager
def database_errors() -> Iterator[None]:
    """Turn a database error into a named fact by the constraint it names; anything
    unrecognised is re-raised as it is."""
    try:
        yield
    except DatabaseError as exc:
        diag = getattr(exc.__cause__, "diag", None)
        constraint = getattr(diag, "constraint_name", None)
        # psycopg 3 names the SQLSTATE ``sqlstate``, psycopg2 ``pgcode``.
        sqlstate = getattr(exc.__cause__, "sqlstate", None) or getattr(
            exc.__cause__, "pgcode", None
        )
        message = getattr(diag, "message_primary", None) or str(exc)
        if constraint == "wd_community_write_fence":
            raise CommunityWriteFenced(message) from exc
        if constraint in _LIFECYCLE_CONSTRAINTS:
            raise InvalidLifecycleTransition(message) from exc
        if constraint == _DELIVERY_PRIMARY_KEY:
            raise DeliveryConflict(
                f"a delivery with this id already exists for another step or target: {message}"
            ) from exc
        if constraint in _REFERENCE_CONSTRAINTS:
            raise ReferenceMissing(
                constraint,
                f"the {_REFERENCE_CONSTRAINTS[constraint]} named by the delivery does not exist "
                f"in its community ({constraint})",
            ) from exc
        if constraint and constraint.startswith("wd_"):
            raise ConstraintViolation(constraint, f"{constraint}: {message}") from exc
        if sqlstate == "25000" and "READ COMMITTED" in message:
            raise IsolationLevelError(message) from exc
        raise
