"""The producer's statements: a step's identity lock, the insert of its deliveries
(one array per column, or the shared columns once), and the wake-ups of idle
consumers, in the insert's statement or after its commit.
"""

from __future__ import annotations

from functools import lru_cache

from ...models import WorkflowAgentDelivery
from ..rows import RECORD_COLUMNS
from ..statement import Statement
from ..wake import WAKE_CHANNEL
from .fragments import DELIVERIES, IDLE, requiring_write
from .fragments import quote_name as _q

# Identity lock of one (community, run, step): producers of the same step queue
# here, so the "already exists?" answer stays true until the commit lands.
_LOCK_STEP = """
SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0))
"""
LOCK_STEP_IDENTITY = Statement(_LOCK_STEP)

# Asked in its own statement once the lock is held: a statement sees only what was
# committed when it began, so the locking statement would miss the commit of the
# producer it waited for.
STEP_EXISTS = Statement(f"""
SELECT EXISTS (
    SELECT 1 FROM {DELIVERIES}
     WHERE community_id = %(community)s AND run_id = %(run)s AND step_id = %(step)s
)
""")

# The columns a producer writes (the record's first thirteen), with their types; a
# row parameter is named after its column.
_WRITTEN_TYPES = ["uuid", "uuid", "uuid", "uuid", "text", "bytea", "bytea", "bytea"]
_WRITTEN_TYPES += ["timestamptz", "text", "bytea", "timestamptz", "uuid"]
INSERT_TYPES = dict(zip(RECORD_COLUMNS[: len(_WRITTEN_TYPES)], _WRITTEN_TYPES, strict=True))
_INSERT_COLUMNS = ", ".join(_q(column) for column in INSERT_TYPES)
# One array parameter per column, unnested into rows: any number of deliveries binds
# 13 parameters, so one prepared statement serves every step size and no step runs
# into PostgreSQL's limit of 65,535 bind parameters.
_INSERT_ROWS = (
    "SELECT * FROM unnest("
    + ", ".join(f"%({column})s::{kind}[]" for column, kind in INSERT_TYPES.items())
    + f") AS v ({_INSERT_COLUMNS})"
)
# The usual step: every delivery shares all but its id and target (the same workflow,
# run, step, definition, message and cause). Those eleven columns are bound once as
# values, and only the ids and targets as arrays, so what a producer sends and what
# the statement unnests grow by two columns per delivery, not thirteen.
PER_DELIVERY = ("id", "target_pubkey")
_SHARED_ROWS = (
    "SELECT "
    + ", ".join(f"{'v' if column in PER_DELIVERY else 's'}.{_q(column)}" for column in INSERT_TYPES)
    + " FROM (SELECT "
    + ", ".join(
        f"%({column})s::{kind} AS {_q(column)}"
        for column, kind in INSERT_TYPES.items()
        if column not in PER_DELIVERY
    )
    + ") AS s CROSS JOIN unnest("
    + ", ".join(f"%({column})s::{INSERT_TYPES[column]}[]" for column in PER_DELIVERY)
    + f") AS v ({', '.join(_q(column) for column in PER_DELIVERY)})"
)

# Returns what a wake-up names besides the id, so ``notifying`` can wrap either insert.
_ON_CONFLICT = (
    "ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING "
    "RETURNING id, community_id, target_pubkey"
)


# The fence's INSERT check runs once per statement, on the rows it created
# (wd_community_write_fence_insert): a retry whose rows are all skipped would pass unasked. The
# producer's statements ask it first themselves, so such a retry is refused too.
def _fence_cte(after: str = "") -> str:
    """The CTE ``fence``: the fence's check of the committing community, evaluated
    once ``after`` (a FROM clause naming an earlier CTE) has been."""
    check = requiring_write("%(community)s::uuid", "INSERT", WorkflowAgentDelivery)
    return f"fence AS MATERIALIZED (SELECT {check}::text AS fenced {after})"


def _insert(rows: str, *, lock: bool) -> Statement:
    """The insert of a step's deliveries from ``rows`` (``_INSERT_ROWS``: one array per
    column; ``_SHARED_ROWS``: the shared columns as values, then the ids and targets);
    an existing identity is skipped. With ``lock``, the step's identity lock comes
    first, for a producer that does not ask whether the step exists: each CTE is
    scanned before any row is produced, in this order (the identity lock first, as in
    ``delivery_identity``), so no row is written without them. Parameters: the
    committing ``community`` (with ``lock``, its ``run`` and ``step`` too), then the
    rows' columns by name."""
    ctes = _fence_cte()
    if lock:
        ctes = f"step_lock AS MATERIALIZED ({_LOCK_STEP.strip()}::text AS locked),\n" + _fence_cte(
            "FROM step_lock"
        )
    return Statement(f"""
WITH {ctes}
INSERT INTO {DELIVERIES} ({_INSERT_COLUMNS})
SELECT v.* FROM ({rows}) AS v CROSS JOIN fence
{_ON_CONFLICT}
""")


INSERT_DELIVERIES = _insert(_INSERT_ROWS, lock=False)
INSERT_SHARED_DELIVERIES = _insert(_SHARED_ROWS, lock=False)
LOCK_AND_INSERT_DELIVERIES = _insert(_INSERT_ROWS, lock=True)
LOCK_AND_INSERT_SHARED_DELIVERIES = _insert(_SHARED_ROWS, lock=True)


# One wake-up per idle (community, target) among the rows a producer created: the
# pairs are deleted from the idle registry (so the next commit to them sends none
# until a consumer registers again) and each is notified once, naming one of its new
# rows. ``woken`` is a data-modifying CTE, so it runs whatever the outer query reads;
# ``sent`` is materialized, so its NOTIFYs are queued exactly once. ``wake.format_wake``
# builds the same text.
_WAKE_IDLE = f"""
woken AS (
    DELETE FROM {IDLE} AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('{WAKE_CHANNEL}', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)"""


@lru_cache(maxsize=8)
def notifying(insert: Statement) -> Statement:
    """Wrap a delivery insert (``… RETURNING id, community_id, target_pubkey``) so the
    same statement wakes the consumers waiting on the targets it created rows for,
    and still returns those rows. Only targets in the idle registry are notified, once
    each, and their registrations are consumed: a producer whose targets have no idle
    consumer sends no NOTIFY and so never queues on the notify lock at its commit. A
    NOTIFY is queued with the transaction: PostgreSQL delivers it on commit and drops
    it (and restores the registrations) on rollback; a skipped duplicate creates no
    row, so it wakes nobody."""
    return Statement(f"""
WITH created AS ({insert.text.strip()}),
{_WAKE_IDLE.strip()}
SELECT created.id, created.community_id, created.target_pubkey FROM created CROSS JOIN sent
""")


# The same wake-ups, sent after the producer's commit in a transaction of their own
# (``WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION = False``): the created rows arrive as
# arrays. Nothing here needs to be durable (the deliveries already are), so this
# commit does not wait for its WAL flush and a notifying one holds the notify lock for
# an instant only.
WAKE_IDLE_AFTER_COMMIT = Statement(f"""
WITH no_flush AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),
created AS (
    SELECT c.* FROM no_flush,
           unnest(%(ids)s::uuid[], %(community_ids)s::uuid[], %(target_pubkeys)s::bytea[])
           AS c (id, community_id, target_pubkey)
),
{_WAKE_IDLE.strip()}
SELECT n FROM sent
""")
