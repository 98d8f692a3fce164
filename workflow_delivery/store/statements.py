"""Every SQL statement of the app, literal, with named parameters, in one place.

Only what the ORM cannot say lives here: ``UPDATE … RETURNING`` with database-clock
arithmetic, ``INSERT … ON CONFLICT``, advisory locks and transaction-local settings.
Identifiers come from model ``_meta`` through ``quote_name``; values are always
parameters (``%(name)s``), each passed once by name. Sections, by who runs them: the
producer, the holder, maintenance (reaper, retention, operator), the roster, the
community fence, the agent API, and the read-only views.

Lease times come from statement_timestamp(), the start of the statement that asks:
now() is the start of the caller's transaction, which may be long past, so by now()
an expired lease could renew itself or a claim hand out a dead lease.
"""

from __future__ import annotations

from functools import lru_cache

from django.db import connection

from ..models import (
    AgentRequestReplay,
    AgentTurn,
    Community,
    CommunityAgent,
    DeliveryTransition,
    Event,
    IdleWakeTarget,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from ..validation import is_whole_number
from ..wakeups import WAKE_CHANNEL
from .rows import RECORD_COLUMNS
from .statement import Statement

_q = quote_name = connection.ops.quote_name

DELIVERIES = _q(WorkflowAgentDelivery._meta.db_table)
COMMUNITIES = _q(Community._meta.db_table)
REPLAYS = _q(AgentRequestReplay._meta.db_table)
IDLE = _q(IdleWakeTarget._meta.db_table)
AGENTS = _q(CommunityAgent._meta.db_table)
TIMELINE = _q(DeliveryTransition._meta.db_table)
EVENTS = _q(Event._meta.db_table)
AGENT_TURNS = _q(AgentTurn._meta.db_table)

_RETURNING = ", ".join(f"d.{_q(column)}" for column in RECORD_COLUMNS)


# wd_community_deletion_key(column) written out: a call of that
# function (its search_path pinned, so never inlined) costs the hot path more than
# the lock it names. tests/test_purge_deadlock.py holds the two equal.
DELETION_KEY = "hashtextextended('workflow_delivery.community_deletion:' || {column}::text, 0)"


def entering_fence(column: str = "community_id") -> str:
    """A condition that takes the shared deletion lock of the row's community (the
    ``column`` of the row being read) and is always true.

    The deletion executor takes the exclusive lock first and then deletes the
    community's rows, so every statement of the app that locks a delivery row takes
    the shared lock first too: in the scan's filter, so before the locking read or
    the UPDATE takes the row. The fence trigger asks for the same lock only once the
    row is locked; a writer that reached it holding a row the executor is about to
    delete would deadlock with the executor. Taken once, the lock is held to the
    end of the transaction, as the trigger's is, and asking again costs nothing."""
    return f"pg_advisory_xact_lock_shared({DELETION_KEY.format(column=column)}) IS NOT NULL"


def entering_fence_once(community: str) -> str:
    """``entering_fence`` for a scan of one community, named by ``community``, an
    expression of no column of the scanned rows: a scalar subquery, so PostgreSQL
    takes the lock once, as a gate before the scan, not in the filter of every row
    the scan reads (a claim reads every row of the oldest ``created_at`` before it
    sorts them by id)."""
    key = DELETION_KEY.format(column=community)
    return f"(SELECT pg_advisory_xact_lock_shared({key})) IS NOT NULL"


# --- The producer --------------------------------------------------------------------

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
    table = WorkflowAgentDelivery._meta.db_table
    check = (
        f"wd_require_community_write(%(community)s::uuid, 'INSERT', '{table}', current_schema())"
    )
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
# ``sent`` is materialized, so its NOTIFYs are queued exactly once. ``wakeups.payload``
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


# --- The holder ----------------------------------------------------------------------

# A consumer with nothing to claim registers its targets as idle, once it listens and
# before its last poll; an existing registration stays as it is.
REGISTER_IDLE = Statement(f"""
INSERT INTO {IDLE} (community_id, target_pubkey)
SELECT %(community_id)s::uuid, t FROM unnest(%(target_pubkeys)s::bytea[]) AS t
ON CONFLICT DO NOTHING
""")

# A consumer that stops cleanly takes its targets' registrations back: nothing of it
# waits for a wake-up any more.
UNREGISTER_IDLE = Statement(f"""
DELETE FROM {IDLE}
 WHERE community_id = %(community_id)s::uuid
   AND target_pubkey = ANY(%(target_pubkeys)s::bytea[])
""")

# A claim stamps its lease by clock_timestamp(), the moment the row is taken: a claim
# statement that began before the row was last reaped can still take it (the locking
# read re-checks the newest version), and its own start would then date the new lease
# before the end of the one it replaces. One stamp per statement, read once every row
# it takes is locked (it depends on ``picked``).
_STAMP = "stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)"

# The winners of ``picked`` claimed: fence bumped, lease stamped, backoff cleared.
_CLAIM_PICKED = f"""
UPDATE {DELIVERIES} AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING {_RETURNING}"""


def _picked(community: str, target: str, match: str = "", limit: str = "1", gate: str = "") -> str:
    """The CTE ``picked``: up to ``limit`` of the target's oldest claimable rows (the
    ``community`` and ``target`` expressions) that also meet ``match`` (more
    conditions on the row) and ``gate`` (a condition of no row, asked first). The
    oldest pending row nobody else holds: a locked row is someone else's claim in
    flight, so it is skipped rather than queued behind. The literal 'pending' lets a
    generic plan use the claim index; a retried row still backing off is passed over
    by a filter on that index scan."""
    return f"""picked AS (
    SELECT id FROM {DELIVERIES}
     WHERE {gate}community_id = {community} AND target_pubkey = {target}{match}
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND {entering_fence_once(community + "::uuid")}
     ORDER BY created_at, id
     LIMIT {limit}
     FOR UPDATE SKIP LOCKED
)"""


def _claim(match: str = "", limit: str = "1") -> Statement:
    """The claim of up to ``limit`` of a target's oldest pending rows that also meet
    ``match`` (``_picked``). Parameters: ``community_id``, ``target_pubkey``,
    ``lease_seconds``, and ``match``'s."""
    picked = _picked("%(community_id)s", "%(target_pubkey)s", match, limit)
    return Statement(f"""
WITH {picked},
{_STAMP}
{_CLAIM_PICKED}
""")


# The single claim, in the shapes its callers use: any row of the target, exactly one
# delivery id, and either one matching every field of an expected binding (its
# cause's identity in the column of its kind: the others are NULL by the table's
# rules).
_BY_ID = "\n       AND id = %(delivery_id)s"
_EXPECTED = """
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND {cause} = %({cause})s"""
_CAUSES = ("cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
CLAIM = _claim()
CLAIM_BY_ID = _claim(_BY_ID)
CLAIM_EXPECTED = {cause: _claim(_EXPECTED.format(cause=cause)) for cause in _CAUSES}
CLAIM_BY_ID_EXPECTED = {cause: _claim(_BY_ID + _EXPECTED.format(cause=cause)) for cause in _CAUSES}

# Batch claim: up to ``limit`` of the target's oldest pending rows in one statement,
# each with its own (incremented) generation, stamped as the single claim is.
CLAIM_BATCH = _claim(limit="%(limit)s")

# Back to pending with the fence bumped, so the holder's lease is dead (reap, release).
_BACK_TO_PENDING = (
    "status = 'pending', lease_generation = d.lease_generation + 1, "
    "lease_until = NULL, claimed_at = NULL"
)
# The lease fields a terminal row gives up (finish, operator mark failed).
_SETTLE = "finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL"


# The four conditions of a live lease: claimed, same generation, same target, not
# expired, against each statement's own clock: the one place the rule is written, for
# every statement that acts on a lease (in-process, the API's, the batch's). The
# lease's fields are expressions: by default the parameters ``community_id``,
# ``delivery_id``, ``target_pubkey`` and ``generation``; ``row`` qualifies the
# delivery row's columns (``"d."``) where another relation has columns of those names.
def _lease(
    community: str = "%(community_id)s",
    target: str = "%(target_pubkey)s",
    *,
    delivery: str = "%(delivery_id)s",
    generation: str = "%(generation)s",
    row: str = "",
) -> str:
    """The capability: the lease's row at its generation, held by its target."""
    return f"""
  {row}community_id = {community} AND {row}id = {delivery}
  AND {row}target_pubkey = {target} AND {row}lease_generation = {generation}
"""


def _live_lease_at_statement(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", **lease: str
) -> str:
    """The capability, still claimed and not expired by the statement's clock."""
    row = lease.get("row", "")
    return f"""{_lease(community, target, **lease)}
  AND {row}status = 'claimed' AND {row}lease_until >= statement_timestamp()
"""


def _live_lease(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", **lease: str
) -> str:
    """The same, and the community's shared deletion lock, taken before the row."""
    fence = entering_fence(lease.get("row", "") + "community_id")
    return f"{_live_lease_at_statement(community, target, **lease)}  AND {fence}\n"


_LEASE = _lease()
_LIVE_LEASE_AT_STATEMENT = _live_lease_at_statement()
_LIVE_LEASE = _live_lease()


def _renew(community: str = "%(community_id)s", target: str = "%(target_pubkey)s") -> str:
    """A live lease extended to ``lease_seconds`` from now; answers the new lease_until."""
    return f"""UPDATE {DELIVERIES}
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE {_live_lease(community, target)}
RETURNING lease_until"""


def _settle(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", *, error: bool = False
) -> str:
    """A live lease settled once: ``outcome``, or with ``error`` failed with the
    holder's error recorded (the ``note`` CTE must come first); answers the status."""
    if error:
        settle = f"status = 'failed', {_SETTLE}, {_RECORD_ERROR}\n  FROM note"
    else:
        settle = f"status = %(outcome)s, {_SETTLE}"
    return f"""UPDATE {DELIVERIES} AS d
   SET {settle}
 WHERE {_live_lease(community, target)}
RETURNING d.status"""


def _seen(community: str, target: str, when: str, **lease: str) -> str:
    """The status of the row the lease's full capability names, read once ``when``
    holds (nothing was settled) with FOR SHARE: a locking read follows a concurrent
    update to its latest committed version, so a retry of a settle sees its terminal
    status where the statement's snapshot would show the row as it was before."""
    capability = _lease(community, target, row="c.", **lease)
    return f"(SELECT c.status FROM {DELIVERIES} AS c WHERE {when} AND {capability} FOR SHARE)"


# The traceback of the error a statement records, for the timeline trigger
# (``wd_record_delivery_transition``), which reads it only for rows whose error that
# statement wrote. Set before any row is written; transaction-local, so in autocommit
# it ends with the statement.
_ERROR_NOTE = (
    "note AS MATERIALIZED "
    "(SELECT set_config('workflow_delivery.error_traceback', %(traceback)s, true) AS traceback)"
)
_RECORD_ERROR = (
    "last_error_type = %(error_type)s, last_error_message = %(error_message)s, "
    "last_error_at = statement_timestamp()"
)

RENEW = Statement(f"\n{_renew()}\n")

FINISH = Statement(f"\n{_settle()}\n")

# After a finish that settled nothing: the row as the caller's full capability sees it.
STATUS_BY_CAPABILITY = Statement(f"SELECT status FROM {DELIVERIES} WHERE {_LEASE}")

# Batch finish: the leases arrive as parallel arrays (community, id, target,
# generation, outcome), one element per distinct capability. Each row settles under
# the live-lease rule as FINISH's; for a capability that settled nothing, the row as
# that capability sees it (``_seen``).
_BATCH_LEASE = {
    "delivery": "l.id",
    "generation": "l.lease_generation",
}
FINISH_BATCH = Statement(f"""
WITH leases AS (
    SELECT * FROM unnest(%(community_ids)s::uuid[], %(delivery_ids)s::uuid[],
                         %(target_pubkeys)s::bytea[], %(generations)s::bigint[],
                         %(outcomes)s::text[])
           WITH ORDINALITY AS l (community_id, id, target_pubkey, lease_generation, outcome, n)
),
settled AS (
    UPDATE {DELIVERIES} AS d
       SET status = l.outcome, {_SETTLE}
      FROM leases AS l
     WHERE {_live_lease("l.community_id", "l.target_pubkey", row="d.", **_BATCH_LEASE)}
    RETURNING l.n
)
SELECT l.n, s.n IS NOT NULL,
       {_seen("l.community_id", "l.target_pubkey", "s.n IS NULL", **_BATCH_LEASE)}
  FROM leases AS l LEFT JOIN settled AS s ON s.n = l.n
""")

# A holder's failed attempt, in one statement under the four conditions of a live
# lease: back to pending with the fence bumped, the error kept, and no claim before
# ``available_at``; or, once the delivery has used every attempt (the cap, NULL for
# none), settled failed as the reaper settles such a lease. The wait is the caller's
# delay if given, else min(most, base * 2^(attempts - 1)) times a random factor from
# 0.5 to 1, so retries of many deliveries that failed together spread out.
RETRY = Statement(f"""
WITH {_ERROR_NOTE}
UPDATE {DELIVERIES} AS d
   SET status = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap THEN 'failed'
                     ELSE 'pending' END,
       lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
       finished_at = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap
                          THEN statement_timestamp() END,
       available_at = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap THEN NULL
           ELSE statement_timestamp() + make_interval(secs => coalesce(
               p.delay,
               least(p.most, p.base * power(2::float8, least(greatest(d.attempts - 1, 0), 60)))
               * (0.5 + random() / 2)))
       END,
       {_RECORD_ERROR}
  FROM note, (SELECT %(cap)s::integer AS cap, %(delay)s::float8 AS delay,
                     %(base)s::float8 AS base, %(most)s::float8 AS most) AS p
 WHERE {_LIVE_LEASE}
RETURNING d.status, d.available_at, d.attempts
""")

# A holder's own failure, with its error: FINISH's settle, recording the error too.
FAIL_WITH_ERROR = Statement(f"""
WITH {_ERROR_NOTE}
{_settle(error=True)}
""")


# A holder's settle and its next claim in one statement, so one commit: ``settled``
# is FINISH's (or FAIL_WITH_ERROR's) settle of the live lease, and the claim's
# ``picked`` is gated on it, so a settle that did not happen claims nothing. The
# held row is claimed, never pending, in the statement's snapshot, so the claim
# cannot pick it. ``community`` and ``target`` name the lease's community and
# target (expressions), ``next_target`` the target whose oldest claimable delivery
# is claimed next; ``error`` settles failed and records the holder's error (the
# ``note`` CTE must come first).
def _settle_and_claim(community: str, target: str, next_target: str, *, error: bool) -> str:
    gate = "EXISTS (SELECT 1 FROM settled) AND "
    return f"""settled AS (
{_settle(community, target, error=error)}
),
{_picked(community, next_target, gate=gate)},
{_STAMP},
claimed AS ({_CLAIM_PICKED}
)"""


def _finish_and_claim_next(*, error: bool) -> Statement:
    """The holder's settle-and-claim. Answers one row: the status settled (NULL when
    nothing was), the status the lease's full capability sees when nothing was
    settled (read FOR SHARE, so the latest committed version: a retry of a settle
    sees its terminal status, as FINISH's follow-up statement would), then the
    claimed record's columns (NULL when nothing was claimed). Parameters: the
    lease's, ``outcome`` (or, with ``error``, ``traceback``, ``error_type``,
    ``error_message``), ``next_target_pubkey``, ``lease_seconds``."""
    operation = _settle_and_claim(
        "%(community_id)s", "%(target_pubkey)s", "%(next_target_pubkey)s", error=error
    )
    note = f"{_ERROR_NOTE},\n" if error else ""
    record = ", ".join(f"n.{_q(column)}" for column in RECORD_COLUMNS)
    return Statement(f"""
WITH {note}{operation}
SELECT s.status,
       {_seen("%(community_id)s", "%(target_pubkey)s", "s.status IS NULL")},
       {record}
  FROM (SELECT 1) AS one
  LEFT JOIN settled AS s ON true
  LEFT JOIN claimed AS n ON true
""")


FINISH_AND_CLAIM_NEXT = _finish_and_claim_next(error=False)
FAIL_WITH_ERROR_AND_CLAIM_NEXT = _finish_and_claim_next(error=True)

# A holder giving its own live lease back (a consumer stopping): back to pending,
# fence bumped, and only at the holder's generation, so a newer holder is untouched.
RELEASE_LEASE = Statement(f"""
UPDATE {DELIVERIES} AS d
   SET {_BACK_TO_PENDING}
 WHERE {_LIVE_LEASE}
RETURNING d.id
""")

# holding(): inside the block's transaction now() stands still at the block's start,
# so time spent waiting for the row or working in the block would not count against
# the lease; each statement's own clock does. Lock the row of a live lease until the
# block's transaction ends, after the community's shared deletion lock (also held to
# the end): a deletion waits for the block, and a purge in progress is waited for
# before the row is taken. A wait behind another locker ends with the WHERE re-read
# on the row as that locker left it (a reap or release bumped the generation: no
# row), but against this statement's start.
HOLD_LOCK = Statement(f"""
SELECT lease_until FROM {DELIVERIES} WHERE {_LIVE_LEASE}   FOR UPDATE
""")

# Asked once the lock is ours, and again before an unfinished block commits: the
# lease may have run out meanwhile, and nobody else can change the row now.
HELD_LIVE = Statement(f"SELECT lease_until FROM {DELIVERIES} WHERE {_LIVE_LEASE_AT_STATEMENT}")

HELD_FINISH = Statement(f"""
UPDATE {DELIVERIES}
   SET status = %(outcome)s, {_SETTLE}
 WHERE {_LIVE_LEASE_AT_STATEMENT}
RETURNING status
""")

# What an ACP agent said in a turn, kept by the runtime in the transaction of the
# settle that ended the attempt, after it (wd_agent_turn_settled refuses the turn of
# an attempt whose claim is still live).
KEEP_AGENT_TURN = Statement(f"""
INSERT INTO {AGENT_TURNS}
    (community_id, delivery_id, attempts, generation, outcome, stop_reason, text,
     said_bytes, tool_calls, permissions)
VALUES (%(community_id)s::uuid, %(delivery_id)s::uuid, %(attempts)s, %(generation)s,
        %(outcome)s, %(stop_reason)s, %(text)s, %(said_bytes)s, %(tool_calls)s::jsonb,
        %(permissions)s::jsonb)
""")

# The message events of claimed or read deliveries, by id, in the caller's community
# (tags as text: decoded as the JSON field decodes them, by ``protocol.stored_message``;
# a JSON content is decoded from its text, the jsonb beside it is not read).
MESSAGE_EVENTS = Statement(f"""
SELECT id, created_at, pubkey, kind, tags::text, content, content_json IS NOT NULL
  FROM {EVENTS}
 WHERE community_id = %(community_id)s::uuid AND id = ANY(%(event_ids)s::bytea[])
""")


# --- Maintenance: the reaper, retention, the operator, the timeline ---------------------

# Who writes in this transaction, for the timeline triggers (wd_delivery_timeline and
# wd_delivery_timeline_commit).
SET_ACTOR = Statement("SELECT set_config('workflow_delivery.actor', %(actor)s, true)")

# Whether this session's writes are recorded in the timeline (a session setting).
SET_TIMELINE = Statement("SELECT set_config('workflow_delivery.timeline', %(timeline)s, false)")

# The timeline entries of the rows a departing statement's ``moved`` CTE answers
# (``community_id``, ``id``, ``status_before``, ``status``, ``lease_generation``,
# ``attempts``, ``claimed_at``: the time of the claim the row had, if any; ``kind``),
# by ``actor``, in one INSERT, unless the session's timeline is off: per row the
# claim it ends, unless an entry records it already (a claim under a named actor, a
# claimed commit), then its own entry; claims first, so each comes before the entry
# that ends it. The entries are those ``wd_record_delivery_departure()`` would write;
# the statement keeps the row trigger off its rows with ``_RECORDING_ON`` (before any
# row is written) and ``_RECORDING_OFF`` (aggregating ``moved``, so only once every
# row is written), and the setting never outlives the statement.
_RECORDING_ON = "set_config('workflow_delivery.recorded_by_statement', 'on', true)"
_RECORDING_OFF = """
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)"""


def _record_moved(actor: str) -> str:
    return f"""
recorded AS (
    INSERT INTO {TIMELINE}
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor)
    SELECT m.community_id, m.id, e.at, e.kind, e.generation, m.attempts, e.status_before,
           e.status_after, e.actor
      FROM moved AS m
     CROSS JOIN LATERAL (
           VALUES (1, m.claimed_at, 'claimed', m.lease_generation - 1, 'pending', 'claimed',
                   'holder'),
                  (2, clock_timestamp(), m.kind, m.lease_generation, m.status_before, m.status,
                   {actor})
     ) AS e (n, at, kind, generation, status_before, status_after, actor)
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
       AND (e.n = 2 OR (m.status_before = 'claimed' AND NOT EXISTS (
           SELECT 1 FROM {TIMELINE} AS t
            WHERE t.community_id = m.community_id AND t.delivery_id = m.id
              AND t.status_after = 'claimed' AND t.attempts = m.attempts
       )))
     ORDER BY e.n
),{_RECORDING_OFF}"""


@lru_cache(maxsize=32)
def reap_batch(size: int, cap: int | None) -> Statement:
    """One bounded batch of the fleet-wide reaper, with its batch size and attempts
    cap (None: no cap) written in; it never waits on a tenant.

    With them as parameters PostgreSQL would plan the statement afresh at every batch
    once the table holds many expired leases, even parked ones it never reads: the
    generic plan, blind to the LIMIT, is estimated dearer than a custom one, and
    planning this statement takes about as long as running a small batch. Without
    parameters there is one plan to keep. A sweep uses one size and one cap, so a
    session prepares few of these.

    1. ``candidates``: active communities with an expired lease, oldest expiry first,
       at most one batch of them (a probe of the reap index each, no row read).
    2. ``tried``: the shared deletion lock of each, *tried*: a community whose
       exclusive lock is held or queued for (a transition, a purge) is skipped for
       this sweep and reported, never waited on.
    3. ``open``: the locked ones still active by a fresh look (community_write_allowed,
       after the lock, so a transition that committed meanwhile is seen and no row of
       a fenced tenant reaches the fence trigger to abort the batch).
    4. ``expired``: the oldest expired rows of those communities only, by the reap
       index; rows a live holder has locked are skipped, not waited for. Rows parked
       in a tenant that is not active are never read, so a batch costs what it
       reclaims, not what is parked.
    5. ``moved``: back to pending, or, once a delivery has used every attempt,
       settled failed; each row answered with the claim it ends (its time from the
       locked row: ``claimed_at`` goes with the lease) and its entry's kind.
    6. ``recorded``: the batch's timeline entries (``_record_moved``), by the reaper.
    The answer: rows returned (reclaimed or, with the cap, failed), how many of them
    the attempts cap failed, and the ids of the tenants skipped locked."""
    if not is_whole_number(size):
        raise TypeError(f"size must be an int, not {size!r}")
    if cap is not None and not is_whole_number(cap):
        raise TypeError(f"cap must be an int or None, not {cap!r}")
    # int() of an int subclass (an IntEnum, say) is the plain number, in digits.
    limit = str(int(size))
    exhausted = (
        f"d.attempts - d.attempts_at_retry >= {'NULL' if cap is None else str(int(cap))}::integer"
    )
    return Statement(f"""
WITH recording AS MATERIALIZED (SELECT {_RECORDING_ON} AS name),
-- Rows another transaction holds (a holder inside holding() past its lease) are
-- skipped before each LIMIT counts, so locked rows never fill a batch or a candidate
-- slot and every unlocked expired lease is reachable.
candidates AS MATERIALIZED (
    SELECT c.id, e.oldest
      FROM recording, {COMMUNITIES} AS c
     CROSS JOIN LATERAL (
           SELECT r.lease_until AS oldest FROM {DELIVERIES} AS r
            WHERE r.community_id = c.id AND r.status = 'claimed'
              AND r.lease_until < statement_timestamp()
            ORDER BY r.lease_until LIMIT 1
              FOR UPDATE OF r SKIP LOCKED
     ) AS e
     WHERE c.deletion_state = 'active'
     ORDER BY e.oldest
     LIMIT {limit}
),
tried AS MATERIALIZED (
    SELECT id, oldest, pg_try_advisory_xact_lock_shared(wd_community_deletion_key(id)) AS locked
      FROM candidates
),
open AS MATERIALIZED (
    SELECT id FROM tried WHERE CASE WHEN locked THEN community_write_allowed(id) ELSE false END
),
expired AS (
    SELECT d.id, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM {DELIVERIES} AS d
     WHERE d.id IN (
           SELECT x.id FROM open
            CROSS JOIN LATERAL (
                  SELECT r.id, r.lease_until FROM {DELIVERIES} AS r
                   WHERE r.community_id = open.id AND r.status = 'claimed'
                     AND r.lease_until < statement_timestamp()
                   ORDER BY r.lease_until LIMIT {limit}
                     FOR UPDATE OF r SKIP LOCKED
            ) AS x
            ORDER BY x.lease_until LIMIT {limit}
     )
       AND d.status = 'claimed' AND d.lease_until < statement_timestamp()
       FOR UPDATE OF d SKIP LOCKED
),
moved AS (
    UPDATE {DELIVERIES} AS d
       SET status = CASE WHEN {exhausted} THEN 'failed' ELSE 'pending' END,
           lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
           finished_at = CASE WHEN {exhausted} THEN statement_timestamp() END
      FROM expired
     WHERE d.id = expired.id
    RETURNING d.community_id, d.id, 'claimed' AS status_before, d.status, d.lease_generation,
              d.attempts, expired.claimed_at,
              CASE WHEN d.status = 'failed' THEN 'attempts_exhausted' ELSE 'reaped' END AS kind
),{_record_moved("'reaper'")}
SELECT recording_done.count,
       (SELECT count(*) FROM moved WHERE status = 'failed'),
       ARRAY(SELECT id FROM tried WHERE NOT locked ORDER BY id)
  FROM recording_done
""")


# Whether an operator's statement may write the community (its shared deletion lock
# tried, not waited for, and its write fence open), and whether the timeline records.
_OPERABLE = f"""operable AS MATERIALIZED (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared(
                         wd_community_deletion_key(%(community_id)s::uuid))
                THEN community_write_allowed(%(community_id)s::uuid) ELSE false END AS ok,
           {_RECORDING_ON} AS recording
)"""


# The operator's statements act on one community, on the rows ``chosen`` (locked, as
# they were): they try its shared deletion lock rather than queue behind a transition
# or a purge (the action then changes nothing and reports the rows as skipped). Each
# writes its rows' timeline entries itself (``_record_moved``), by ``actor``, and
# answers the ids it changed. Parameters: ``community_id``, ``delivery_ids``, ``actor``.
def _operator_statement(statuses: str, write: str, kind: str) -> Statement:
    return Statement(f"""
WITH {_OPERABLE},
chosen AS (
    SELECT d.id, d.status, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM {DELIVERIES} AS d
     WHERE d.community_id = %(community_id)s AND d.id = ANY(%(delivery_ids)s)
       AND d.status IN ({statuses})
       AND (SELECT ok FROM operable)
       FOR UPDATE OF d
),
moved AS (
    UPDATE {DELIVERIES} AS d
       SET {write}
      FROM chosen
     WHERE d.community_id = %(community_id)s AND d.id = chosen.id
    RETURNING d.community_id, d.id, chosen.status AS status_before, d.status,
              d.lease_generation, d.attempts,
              CASE WHEN chosen.status = 'claimed' THEN chosen.claimed_at END AS claimed_at,
              '{kind}' AS kind
),{_record_moved("%(actor)s::text")}
SELECT moved.id FROM moved, recording_done
""")


# An operator's release of chosen claimed rows (admin): back to pending, fence bumped.
RELEASE = _operator_statement("'claimed'", _BACK_TO_PENDING, "released")

# An operator's terminal for chosen non-terminal rows (admin), recorded as failed. The
# generation is bumped too, so a live holder's finish gets LeaseLost rather than an
# AlreadyTerminal it could mistake for its own earlier settle.
MARK_FAILED = _operator_statement(
    "'pending', 'claimed'",
    f"status = 'failed', lease_generation = d.lease_generation + 1, {_SETTLE}, available_at = NULL",
    "operator_failed",
)

# An operator's retry of chosen failed rows (admin, ``retry_deliveries``): back to
# pending with the fence bumped and the attempts budget renewed, claimable at once,
# the error of the last attempt kept; a finished row is never chosen (nor could it be
# reopened: ``wd_delivery_transition_guard``). Its timeline entry carries ``reason``.
# Parameters: ``community_id``, ``delivery_ids``, ``actor``, ``reason``.
OPERATOR_RETRY = Statement(f"""
WITH {_OPERABLE},
chosen AS (
    SELECT d.id FROM {DELIVERIES} AS d
     WHERE d.community_id = %(community_id)s AND d.id = ANY(%(delivery_ids)s)
       AND d.status = 'failed' AND (SELECT ok FROM operable)
       FOR UPDATE OF d
),
moved AS (
    UPDATE {DELIVERIES} AS d
       SET status = 'pending', lease_generation = d.lease_generation + 1,
           finished_at = NULL, available_at = NULL, attempts_at_retry = d.attempts
      FROM chosen
     WHERE d.community_id = %(community_id)s AND d.id = chosen.id
    RETURNING d.community_id, d.id, d.lease_generation, d.attempts
),
recorded AS (
    INSERT INTO {TIMELINE}
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor, reason)
    SELECT m.community_id, m.id, clock_timestamp(), 'operator_retried', m.lease_generation,
           m.attempts, 'failed', 'pending', %(actor)s::text, %(reason)s::text
      FROM moved AS m
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
),{_RECORDING_OFF}
SELECT moved.id FROM moved, recording_done
""")

# One bounded batch of retention: terminal rows settled at or before the cut-off, of
# communities that are active and whose deletion lock is free (tried, never waited
# for; the CTE is evaluated once per statement). Their timeline goes by cascade.
PRUNE_BATCH = Statement(f"""
WITH allowed AS MATERIALIZED (
    SELECT id FROM {COMMUNITIES}
     WHERE deletion_state = 'active' AND wd_community_prune_allowed(id)
),
doomed AS (
    SELECT d.community_id, d.id FROM {DELIVERIES} AS d JOIN allowed AS a ON a.id = d.community_id
     WHERE d.status IN ('finished', 'failed') AND d.finished_at <= %(cutoff)s
     LIMIT %(limit)s
     FOR UPDATE OF d SKIP LOCKED
)
DELETE FROM {DELIVERIES} AS d
 USING doomed
 WHERE d.community_id = doomed.community_id AND d.id = doomed.id
RETURNING d.community_id
""")

# By the statement clock, as settles are stamped (finish_delivery, the reaper).
PRUNE_CUTOFF = Statement("SELECT statement_timestamp() - %(age)s::interval")

# What a prune would delete, per community (a dry run, and the progress bar's total).
PRUNE_COUNT = Statement(f"""
SELECT c.id, c.host, count(*)
  FROM {COMMUNITIES} AS c JOIN {DELIVERIES} AS d ON d.community_id = c.id
 WHERE c.deletion_state = 'active' AND d.status IN ('finished', 'failed')
   AND d.finished_at <= %(cutoff)s
 GROUP BY c.id, c.host ORDER BY c.host
""")

# One bounded batch of replay-guard pruning across communities: only rows whose
# event can no longer pass the freshness window, only in active communities whose
# deletion lock is free right now (a tenant being deleted is skipped, never waited
# for; its purge removes its rows).
PRUNE_REPLAYS_BATCH = Statement(f"""
WITH open AS (
    SELECT id FROM {COMMUNITIES}
     WHERE deletion_state = 'active'
       AND pg_try_advisory_xact_lock_shared(wd_community_deletion_key(id))
), doomed AS (
    SELECT r.id FROM {REPLAYS} AS r
     WHERE r.event_created_at < now() - make_interval(secs => %(horizon)s)
       AND r.community_id IN (SELECT id FROM open)
     LIMIT %(limit)s
     FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM {REPLAYS} AS r USING doomed WHERE r.id = doomed.id
""")


# --- The agent roster ----------------------------------------------------------------

# Columns of an entry, in the order ``roster.RosterEntry`` takes them.
_ROSTER_ENTRY = "a.community_id, a.pubkey, a.label, a.enabled, a.added_at, a.revoked_at"

# Enrolls keys as enabled agents; a key already in the roster keeps its standing
# (a revoked one stays revoked) and takes the label given, if one is. Every row is
# returned.
ENROLL_AGENTS = Statement(f"""
INSERT INTO {AGENTS} AS a (community_id, pubkey, label)
SELECT %(community_id)s::uuid, k.pubkey, coalesce(%(label)s::text, '')
  FROM unnest(%(pubkeys)s::bytea[]) AS k (pubkey)
ON CONFLICT ON CONSTRAINT wd_agent_key
DO UPDATE SET label = coalesce(%(label)s::text, a.label)
RETURNING {_ROSTER_ENTRY}
""")

# A revocation's order of locks, as every writer takes them (wd_lock_roster_shared): the
# community's deletion lock shared (the fence's own check, refusing a tenant that is
# not active), then its roster lock exclusive, which waits for every commit and
# every API request of the community that read the roster before us.
LOCK_ROSTER_EXCLUSIVE = Statement(f"""
SELECT wd_require_community_write(%(community_id)s::uuid, 'UPDATE',
                                  '{CommunityAgent._meta.db_table}', current_schema()),
       pg_advisory_xact_lock(wd_community_roster_key(%(community_id)s::uuid))
""")

# Revoked once: a second revocation keeps the first's time.
REVOKE_AGENT = Statement(f"""
UPDATE {AGENTS} AS a
   SET enabled = false, revoked_at = coalesce(a.revoked_at, statement_timestamp())
 WHERE a.community_id = %(community_id)s AND a.pubkey = %(pubkey)s
RETURNING {_ROSTER_ENTRY}
""")

# Every lease the revoked key holds in the community, live or expired: back to
# pending with the fence bumped, so its late renew or finish is lease lost.
RELEASE_AGENT_LEASES = Statement(f"""
UPDATE {DELIVERIES} AS d
   SET {_BACK_TO_PENDING}
 WHERE d.community_id = %(community_id)s AND d.target_pubkey = %(pubkey)s
   AND d.status = 'claimed'
RETURNING d.id
""")

REINSTATE_AGENT = Statement(f"""
UPDATE {AGENTS} AS a
   SET enabled = true, revoked_at = NULL
 WHERE a.community_id = %(community_id)s AND a.pubkey = %(pubkey)s
RETURNING {_ROSTER_ENTRY}
""")


# --- The community fence and its executor ----------------------------------------------

# The fence's own rule, wd_require_read_committed(): READ COMMITTED or a clear error.
REQUIRE_READ_COMMITTED = Statement("SELECT wd_require_read_committed()")

COMMUNITY_WRITE_ALLOWED = Statement("SELECT community_write_allowed(%(community_id)s::uuid)")

# The executor's exclusive deletion lock: waits for writers already past the
# fence (they hold the shared lock until commit) and holds back new ones.
LOCK_COMMUNITY_EXCLUSIVE = Statement(
    "SELECT pg_advisory_xact_lock(wd_community_deletion_key(%(community_id)s::uuid))"
)

COMMUNITY_FENCE_STATE = Statement(f"""
SELECT deletion_state, deletion_fence_generation FROM {COMMUNITIES} WHERE id = %(community_id)s
   FOR NO KEY UPDATE
""")

SET_COMMUNITY_STATE = Statement(f"""
UPDATE {COMMUNITIES} SET deletion_state = %(state)s WHERE id = %(community_id)s
RETURNING deletion_fence_generation
""")

# Recorded by the database where only the migrating role writes
# (wd_executor_presentations, guarded by wd_executor_presentation_by_owner);
# EXECUTE is the owner's and an executor role's, never PUBLIC's.
PRESENT_EXECUTOR = Statement(
    "SELECT wd_present_executor(%(community_id)s::uuid, %(generation)s::bigint)"
)

WITHDRAW_EXECUTOR = Statement("SELECT wd_withdraw_executor()")

CURRENT_ROLE = Statement("SELECT current_user")

# The purge of one community's rows, table by table, children first, so no foreign
# key refuses it: each statement deletes at most ``limit`` rows of its table, so one
# transaction of the executor (which holds the exclusive deletion lock) stays short.
PURGE = [
    (
        table,
        Statement(
            f"DELETE FROM {_q(table)} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {_q(table)} "
            "WHERE community_id = %(community_id)s LIMIT %(limit)s))"
        ),
    )
    for table in [
        AgentTurn._meta.db_table,
        CommunityAgent._meta.db_table,
        IdleWakeTarget._meta.db_table,
        DeliveryTransition._meta.db_table,
        AgentRequestReplay._meta.db_table,
        WorkflowAgentDelivery._meta.db_table,
        WorkflowRun._meta.db_table,
        Workflow._meta.db_table,
        Event._meta.db_table,
    ]
]


# --- The agent API -------------------------------------------------------------------

# The agent API's freshness check and replay guard in one statement, both by the
# database clock: a fresh event's id is recorded, and ON CONFLICT makes a second
# arrival of the same event (from any process, at the same instant, for any
# community) insert nothing. Answers (fresh, recorded).
ACCEPT_REQUEST_EVENT = Statement(f"""
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), recorded AS (
    INSERT INTO {REPLAYS} (community_id, event_id, event_created_at)
    SELECT %(community_id)s::uuid, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM clock WHERE clock.fresh
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING 1
)
SELECT clock.fresh, EXISTS (SELECT 1 FROM recorded) FROM clock
""")

# The same for a request named by its Host: the community whose host it is (any
# case, by wd_community_host_ci_key), where the signing key stands in its roster,
# the freshness and the replay guard, in one round trip. The standing is read under
# the roster's shared lock (wd_agent_standing, through wd_lock_roster_shared), held to the end of
# the request's transaction, so a revocation waits for the key's requests in flight.
# The community's shared deletion lock is only tried, never waited for: while its
# deletion executor holds the exclusive lock (or waits for it), the standing is
# ``ADMISSION_DELETING`` and nothing is recorded, so a request of a community being
# deleted holds no server thread. Only an enabled agent's fresh event is recorded.
# Answers (community id or NULL, fresh, recorded, standing or ADMISSION_DELETING or
# NULL); an unknown host records nothing.
# Parameters: ``created_at``, ``skew`` (the freshness window), ``host``, ``pubkey``,
# ``event_id``.
ADMISSION_DELETING = "deleting"
_ADMISSION_CTES = f"""
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM {COMMUNITIES} WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared({DELETION_KEY.format(column="id")}) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE '{ADMISSION_DELETING}' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO {REPLAYS} (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
)"""
ADMIT_REQUEST_EVENT = Statement(f"""{_ADMISSION_CTES}
SELECT (SELECT id FROM community), clock.fresh, EXISTS (SELECT 1 FROM recorded),
       (SELECT standing FROM agent)
  FROM clock
""")


# The agent API's requests, each admitted and served by one statement in autocommit
# (``services.holder``'s ``*_admitted`` functions): ADMIT_REQUEST_EVENT's look-ups,
# freshness and replay guard, then the holder's operation, built from the same
# fragments as the in-process one (``_picked``, ``_renew``, ``_settle``, ``_seen``),
# on the community the replay row was recorded for, the caller's key as the target
# (nothing runs when the request was not admitted). The statement is its own
# transaction, so the replay row commits with the operation or not at all; an
# operation that refuses calls wd_refuse_request (``_REFUSE``), whose error
# (``REQUEST_REFUSED``) rolls back both. Parameters: the admission's, then the
# operation's. Every answer row starts with the admission (community id or NULL,
# fresh, recorded, standing or NULL).
def _admitted(operation: str, answer: str) -> Statement:
    return Statement(f"""{_ADMISSION_CTES}, admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), {operation}
{answer}
""")


_ADMISSION = "a.community_id, a.fresh, a.recorded, a.standing"
_ADMITTED_COMMUNITY = "(SELECT community_id FROM recorded)"
_CALLER = "%(pubkey)s"
# Raises ``errors.REQUEST_REFUSED``: the request's statement rolls back as a whole.
_REFUSE = "wd_refuse_request('lease_lost')"

# A claimed row ``n``'s record and its message event (the event's columns NULL when
# the event is not stored), read as ``protocol.stored_message`` takes them.
_CLAIMED_RECORD = ", ".join(f"n.{_q(column)}" for column in RECORD_COLUMNS)
_MESSAGE_COLUMNS = (
    "e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL"
)
_MESSAGE_OF_CLAIMED = f"""LEFT JOIN {EVENTS} AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id"""


# A settle's answer on an admitted request: the status settled, and for a lease that
# settled nothing the row as the caller's capability sees it (``_seen``). A terminal
# row answers its status (a retry of a settle); anything else refuses (``lease_lost``).
_SERVED_SEEN = f"""seen AS (
    SELECT a.recorded, s.status AS settled,
           {_seen("a.community_id", _CALLER, "a.recorded AND s.status IS NULL")} AS status
      FROM admission AS a LEFT JOIN settled AS s ON true
)"""
_REFUSE_UNLESS_SETTLED = f"""CASE WHEN seen.recorded AND seen.settled IS NULL
                 AND (seen.status IS NULL OR seen.status NOT IN ('finished', 'failed'))
            THEN {_REFUSE} END"""


def _served_claim(match: str = "", limit: str = "%(limit)s") -> Statement:
    """The holder's claim (``_claim``) of the caller's oldest claimable deliveries that
    meet ``match``, up to ``limit``, each answered with its record and its message;
    one row of admission alone when nothing was claimed. Parameters after the
    admission's: ``lease_seconds``, ``limit`` and ``match``'s."""
    return _admitted(
        f"""{_picked(_ADMITTED_COMMUNITY, _CALLER, match, limit)},
{_STAMP},
claimed AS ({_CLAIM_PICKED}
)""",
        f"""SELECT {_ADMISSION}, {_CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  {_MESSAGE_OF_CLAIMED}""",
    )


# The claim in the holder's shapes (CLAIM_BATCH's with a limit, a limit of 1 being the
# single claim; CLAIM_BY_ID's; CLAIM_EXPECTED's and CLAIM_BY_ID_EXPECTED's by cause).
SERVED_CLAIM = _served_claim()
SERVED_CLAIM_BY_ID = _served_claim(_BY_ID, limit="1")
SERVED_CLAIM_EXPECTED = {
    cause: _served_claim(_EXPECTED.format(cause=cause), limit="1") for cause in _CAUSES
}
SERVED_CLAIM_BY_ID_EXPECTED = {
    cause: _served_claim(_BY_ID + _EXPECTED.format(cause=cause), limit="1") for cause in _CAUSES
}

# Renew the caller's live lease (RENEW); a lost one refuses (``lease_lost``).
# Parameters after the admission's: ``lease_seconds``, ``delivery_id``,
# ``generation``. Answers the admission and the new lease_until.
SERVED_RENEW = _admitted(
    f"""renewed AS (
{_renew(_ADMITTED_COMMUNITY, _CALLER)}
)""",
    f"""SELECT {_ADMISSION}, r.lease_until,
       CASE WHEN a.recorded AND r.lease_until IS NULL THEN {_REFUSE} END
  FROM admission AS a LEFT JOIN renewed AS r ON true""",
)

# Settle the caller's live lease once (FINISH), answered as ``_SERVED_SEEN``.
# Parameters after the admission's: ``outcome``, ``delivery_id``, ``generation``.
# Answers the admission, the settled status, the status seen.
SERVED_FINISH = _admitted(
    f"""settled AS (
{_settle(_ADMITTED_COMMUNITY, _CALLER)}
), {_SERVED_SEEN}""",
    f"""SELECT {_ADMISSION}, seen.settled, seen.status, {_REFUSE_UNLESS_SETTLED}
  FROM admission AS a, seen""",
)

# Settle the caller's live lease once and claim the caller's oldest claimable
# delivery with it: the holder's settle-and-claim (``_settle_and_claim``), answered
# as SERVED_FINISH (a settle that did not happen claims nothing). Parameters after
# the admission's: ``outcome``, ``delivery_id``, ``generation``, ``lease_seconds``.
# Answers the admission, the settled status, the status seen, the refusal's column,
# then the claimed record and its message (NULL when nothing was claimed).
SERVED_FINISH_AND_CLAIM_NEXT = _admitted(
    f"""{_settle_and_claim(_ADMITTED_COMMUNITY, _CALLER, _CALLER, error=False)},
{_SERVED_SEEN}""",
    f"""SELECT {_ADMISSION}, seen.settled, seen.status, {_REFUSE_UNLESS_SETTLED},
       {_CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM admission AS a CROSS JOIN seen
  LEFT JOIN claimed AS n ON true
  {_MESSAGE_OF_CLAIMED}""",
)

# The claim of a request admitted earlier (a waiting claim, after its wake-up): the
# single claim of the key's oldest claimable delivery, with its message, only while
# the key is an enabled agent of the community. The standing is read once, as a gate
# before the scan, under the roster's shared lock (``wd_agent_standing``), held to
# the end of the statement's transaction: a revocation waits for the claim, and a
# claim after a revocation takes nothing. Parameters: ``community_id``,
# ``target_pubkey``, ``lease_seconds``. Answers the claimed record and its message,
# no row when nothing was claimed.
_ENROLLED = (
    "(SELECT wd_agent_standing(%(community_id)s::uuid, %(target_pubkey)s::bytea)) = 'enabled' AND "
)
CLAIM_ENROLLED = Statement(f"""
WITH {_picked("%(community_id)s", "%(target_pubkey)s", gate=_ENROLLED)},
{_STAMP},
claimed AS ({_CLAIM_PICKED}
)
SELECT {_CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM claimed AS n
  {_MESSAGE_OF_CLAIMED}
""")


# --- Read-only views: metrics, the admin's overview and target page --------------------

# Metrics: each served by a partial index (the heap of terminal rows is never read).
METRICS_COMMUNITIES = Statement(f"SELECT id, host, deletion_state FROM {COMMUNITIES}")
METRICS_PENDING = Statement(f"""
SELECT community_id, count(*), extract(epoch FROM now() - min(created_at))
  FROM {DELIVERIES} WHERE status = 'pending' GROUP BY community_id
""")
METRICS_CLAIMED = Statement(f"""
SELECT community_id, count(*), count(*) FILTER (WHERE lease_until < now())
  FROM {DELIVERIES} WHERE status = 'claimed' GROUP BY community_id
""")
METRICS_TERMINAL = Statement(f"""
SELECT community_id, status, count(*)
  FROM {DELIVERIES} WHERE status IN ('finished', 'failed') GROUP BY community_id, status
""")

# Settles of the last hour per minute, oldest first: each terminal delivery settled
# once, at its finished_at, read from the settled index per community and status.
SETTLES_PER_MINUTE = Statement(f"""
SELECT minutes.m, count(s.finished_at)
  FROM generate_series(0, 59) AS minutes (m)
  LEFT JOIN (
       SELECT d.finished_at
         FROM {COMMUNITIES} AS c
        CROSS JOIN (VALUES ('finished'), ('failed')) AS t (status)
        CROSS JOIN LATERAL (
              SELECT r.finished_at FROM {DELIVERIES} AS r
               WHERE r.community_id = c.id AND r.status = t.status
                 AND r.finished_at > now() - interval '60 minutes'
        ) AS d
  ) AS s
    ON 59 - greatest(0, floor(extract(epoch FROM now() - s.finished_at) / 60)::int) = minutes.m
 GROUP BY minutes.m ORDER BY minutes.m
""")

# The admin's "why not delivered?" for one (community, target), in one statement, by
# the database clock. Pending rows come from the claim index and claimed rows from the
# community's reap index; terminal rows have no index by target, so settles are read
# from the community's ``window`` most recent (two backward scans of the settled
# index, one per terminal status) and only those are searched for the target. The last
# claim is the newest ``last_claimed_at`` of the target's claimed and pending rows and
# of its settles in that window.
_ERROR_COLUMNS = "last_error_type, last_error_message, last_error_at"
_SETTLE_ROW = (
    "id, target_pubkey, status, attempts, attempts_at_retry, finished_at, last_claimed_at, "
    f"{_ERROR_COLUMNS}"
)
TARGET_STATE = Statement(f"""
WITH community AS (
    SELECT host, deletion_state FROM {COMMUNITIES} WHERE id = %(community)s
),
pending AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE available_at > statement_timestamp()) AS backing_off,
           min(available_at) FILTER (WHERE available_at > statement_timestamp()) AS next_at,
           min(created_at) AS oldest
      FROM {DELIVERIES}
     WHERE community_id = %(community)s AND target_pubkey = %(target)s AND status = 'pending'
),
held AS MATERIALIZED (
    SELECT id, claimed_at, last_claimed_at, lease_until, {_ERROR_COLUMNS}
      FROM {DELIVERIES}
     WHERE community_id = %(community)s AND status = 'claimed' AND target_pubkey = %(target)s
),
claimed AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE lease_until < statement_timestamp()) AS expired,
           min(lease_until) FILTER (WHERE lease_until < statement_timestamp()) AS first_expired,
           max(lease_until) FILTER (WHERE lease_until >= statement_timestamp()) AS live_until,
           max(claimed_at) AS last_claimed
      FROM held
),
recent AS MATERIALIZED (
    SELECT * FROM (
        (SELECT {_SETTLE_ROW} FROM {DELIVERIES}
          WHERE community_id = %(community)s AND status = 'finished'
          ORDER BY finished_at DESC LIMIT %(window)s)
        UNION ALL
        (SELECT {_SETTLE_ROW} FROM {DELIVERIES}
          WHERE community_id = %(community)s AND status = 'failed'
          ORDER BY finished_at DESC LIMIT %(window)s)
    ) AS settles
     ORDER BY finished_at DESC LIMIT %(window)s
),
settled AS (
    SELECT count(*) AS window_rows, min(finished_at) AS window_since,
           count(*) FILTER (WHERE target_pubkey = %(target)s) AS total,
           max(finished_at) FILTER (WHERE target_pubkey = %(target)s) AS last_settled,
           count(*) FILTER (
               WHERE target_pubkey = %(target)s AND status = 'failed'
                 AND attempts - attempts_at_retry >= %(cap)s
           ) AS exhausted
      FROM recent
),
error AS (
    SELECT * FROM (
        SELECT {_ERROR_COLUMNS} FROM {DELIVERIES}
         WHERE community_id = %(community)s AND target_pubkey = %(target)s
           AND status = 'pending' AND last_error_at IS NOT NULL
        UNION ALL
        SELECT {_ERROR_COLUMNS} FROM held WHERE last_error_at IS NOT NULL
        UNION ALL
        SELECT {_ERROR_COLUMNS} FROM recent
         WHERE target_pubkey = %(target)s AND last_error_at IS NOT NULL
    ) AS errors
     ORDER BY last_error_at DESC LIMIT 1
),
claim AS (
    SELECT max(last_claimed_at) AS last_claimed
      FROM (
            SELECT last_claimed_at FROM held
            UNION ALL
            SELECT last_claimed_at FROM recent WHERE target_pubkey = %(target)s
            UNION ALL
            SELECT max(last_claimed_at) FROM {DELIVERIES}
             WHERE community_id = %(community)s AND target_pubkey = %(target)s
               AND status = 'pending'
      ) AS seen
),
idle AS (
    SELECT registered_at FROM {IDLE}
     WHERE community_id = %(community)s AND target_pubkey = %(target)s
)
SELECT statement_timestamp(), community.host, community.deletion_state,
       pending.total, pending.backing_off, pending.next_at, pending.oldest,
       claimed.total, claimed.expired, claimed.first_expired, claimed.live_until,
       greatest(claimed.last_claimed, claim.last_claimed),
       settled.window_rows, settled.window_since, settled.total, settled.last_settled,
       settled.exhausted,
       error.last_error_type, error.last_error_message, error.last_error_at,
       idle.registered_at
  FROM pending
 CROSS JOIN claimed
 CROSS JOIN settled
 CROSS JOIN claim
  LEFT JOIN community ON true
  LEFT JOIN error ON true
  LEFT JOIN idle ON true
""")


# --- The consumer's heartbeat --------------------------------------------------------

# The heartbeat's renew (RENEW) that waits at most ``lock_timeout`` (a setting's text,
# '500ms') for a lock, in one statement: the scalar subquery is a gate PostgreSQL
# evaluates once, before the scan (a one-time filter), so the transaction-local
# setting holds for every lock the renew then waits for, the deletion lock and the
# row. In autocommit the statement is its own transaction, and the setting ends
# with it. Answers the new lease_until.
HEARTBEAT_RENEW = Statement(f"""
UPDATE {DELIVERIES}
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE {_LIVE_LEASE}  AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true)) IS NOT NULL
RETURNING lease_until
""")
