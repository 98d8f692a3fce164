"""The fragments the statements of every audience are built from, each rule once.

The tables' quoted names; the community's deletion lock, entered (waited for) or
tried (and the community skipped); a row's transitions (the fence bump, back to
pending, settled, the terminal statuses, the attempts cap, an attempt that ended
unsettled) and the write fence's own check; the claim (which rows are claimable,
the stamp, the update of the winners, as a statement or as CTEs); the lease (the
capability, the live-lease rule and the expired lease, its renew, its settle, the
status a capability sees, the settle and the next claim). A statement that needs a
rule is built from its fragment here, so a reviewer reads each rule in one place and
``statements.sql`` shows it whole in every statement that uses it.
"""

from __future__ import annotations

from django.db import connection
from django.db.models import Model

from ...models import (
    AgentRequestReplay,
    AgentTurn,
    Community,
    CommunityAgent,
    DeliveryTransition,
    Event,
    IdleWakeTarget,
    WorkflowAgentDelivery,
)
from ..rows import RECORD_COLUMNS

quote_name = connection.ops.quote_name

DELIVERIES = quote_name(WorkflowAgentDelivery._meta.db_table)
COMMUNITIES = quote_name(Community._meta.db_table)
REPLAYS = quote_name(AgentRequestReplay._meta.db_table)
IDLE = quote_name(IdleWakeTarget._meta.db_table)
AGENTS = quote_name(CommunityAgent._meta.db_table)
TIMELINE = quote_name(DeliveryTransition._meta.db_table)
EVENTS = quote_name(Event._meta.db_table)
AGENT_TURNS = quote_name(AgentTurn._meta.db_table)

# A delivery row ``d``'s record, in the order ``rows`` decodes it.
RETURNING_RECORD = ", ".join(f"d.{quote_name(column)}" for column in RECORD_COLUMNS)


# --- The community's deletion lock ----------------------------------------------------

# wd_community_deletion_key(column) written out, in every statement that takes the
# shared lock or tries it: a call of that function (its search_path pinned, so never
# inlined) costs the hot path more than the lock it names. tests/services/test_purge_deadlock.py
# holds the two equal.
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


def trying_fence(community: str) -> str:
    """The shared deletion lock of ``community`` (an expression), tried rather than
    waited for: true once held (to the end of the transaction), false at once while
    the community's deletion executor holds the exclusive lock or waits for it. A
    statement that must not queue behind a transition or a purge skips the community
    on false: the request admission, the reaper, the operator, replay-guard pruning."""
    return f"pg_try_advisory_xact_lock_shared({DELETION_KEY.format(column=community)})"


def open_once_tried(tried: str, community: str) -> str:
    """Whether a statement may write ``community`` without waiting: its lock tried
    (``tried``: a ``trying_fence``, or a column that holds one's answer) and, once
    held, the fence open by a fresh look (community_write_allowed, so a transition
    committed before the lock was taken is seen and no row of a fenced community
    reaches the fence trigger to abort the statement)."""
    return f"CASE WHEN {tried} THEN community_write_allowed({community}) ELSE false END"


# --- A row's transitions ---------------------------------------------------------------

# The fence bumped: the generation moves on, so a capability of the generation before
# is dead (its late renew or finish is lease lost). On a delivery row ``d``.
FENCE_BUMP = "lease_generation = d.lease_generation + 1"
# The lease fields a row gives up when its lease ends.
LEASE_CLEARED = "lease_until = NULL, claimed_at = NULL"
# Back to pending with the fence bumped, so the holder's lease is dead (reap, release).
BACK_TO_PENDING = f"status = 'pending', {FENCE_BUMP}, {LEASE_CLEARED}"
# The lease fields a terminal row gives up (finish, operator mark failed).
SETTLE = f"finished_at = statement_timestamp(), {LEASE_CLEARED}"
# The terminal statuses: a row settled once, never claimed or settled again
# (wd_delivery_transition_guard), but for an operator's retry of a failed one.
TERMINAL = "('finished', 'failed')"


def attempts_exhausted(cap: str, row: str = "d.") -> str:
    """Whether the row has used every attempt ``cap`` allows since its last operator
    retry (a NULL cap: never)."""
    return f"{row}attempts - {row}attempts_at_retry >= {cap}"


def attempt_ended(cap: str) -> str:
    """The SET list of a delivery row ``d`` whose lease ended unsettled (the holder's
    retry, the reaper): failed for good once it has used every attempt ``cap`` allows,
    else back to pending; the fence bumped and the lease cleared either way."""
    exhausted = attempts_exhausted(cap)
    return (
        f"status = CASE WHEN {exhausted} THEN 'failed' ELSE 'pending' END,\n"
        f"       {FENCE_BUMP}, {LEASE_CLEARED},\n"
        f"       finished_at = CASE WHEN {exhausted} THEN statement_timestamp() END"
    )


def requiring_write(community: str, operation: str, model: type[Model]) -> str:
    """The write fence's own check, as its trigger makes it (wd_require_community_write):
    the community's shared deletion lock taken, then a clear error unless the community
    is active (or this transaction is its deletion executor), naming ``operation`` on
    ``model``'s table. For a statement that must be refused before it writes a row."""
    table = model._meta.db_table
    return f"wd_require_community_write({community}, '{operation}', '{table}', current_schema())"


# --- The claim -----------------------------------------------------------------------

# A row a claim may take: pending, and past its backoff by the statement's clock (a
# retried row waits until ``available_at``). The literal 'pending' lets a generic plan
# use the claim index; the backoff is a filter on that index scan. ``picked`` takes
# the community's shared deletion lock before the scan (``entering_fence_once``).
CLAIMABLE = """status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())"""

# A claim stamps its lease by clock_timestamp(), the moment the row is taken: a claim
# statement that began before the row was last reaped can still take it (the locking
# read re-checks the newest version), and its own start would then date the new lease
# before the end of the one it replaces. One stamp per statement, read once every row
# it takes is locked (it depends on ``picked``).
STAMP = "stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)"

# The winners of ``picked`` claimed: fence bumped, lease stamped, backoff cleared.
CLAIM_PICKED = f"""
UPDATE {DELIVERIES} AS d
   SET status = 'claimed',
       {FENCE_BUMP},
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING {RETURNING_RECORD}"""


def picked(community: str, target: str, match: str = "", limit: str = "1", gate: str = "") -> str:
    """The CTE ``picked``: up to ``limit`` of the target's oldest claimable rows (the
    ``community`` and ``target`` expressions) that also meet ``match`` (more
    conditions on the row) and ``gate`` (a condition of no row, asked first). The
    oldest pending row nobody else holds: a locked row is someone else's claim in
    flight, so it is skipped rather than queued behind (``CLAIMABLE``)."""
    return f"""picked AS (
    SELECT id FROM {DELIVERIES}
     WHERE {gate}community_id = {community} AND target_pubkey = {target}{match}
       AND {CLAIMABLE}
       AND {entering_fence_once(community + "::uuid")}
     ORDER BY created_at, id
     LIMIT {limit}
     FOR UPDATE SKIP LOCKED
)"""


def claiming(community: str, target: str, match: str = "", limit: str = "1", gate: str = "") -> str:
    """The claim as CTEs of a larger statement: ``picked`` (of these arguments),
    ``stamp``, and ``claimed``, the claimed rows' records (``CLAIMED_RECORD``)."""
    return f"""{picked(community, target, match, limit, gate)},
{STAMP},
claimed AS ({CLAIM_PICKED}
)"""


# The record of a row of ``claimed``, read as ``n``, in the order ``rows`` decodes it.
CLAIMED_RECORD = ", ".join(f"n.{quote_name(column)}" for column in RECORD_COLUMNS)


# The single claim, in the shapes its callers use: any row of the target, exactly one
# delivery id, and either one matching every field of an expected binding (its
# cause's identity in the column of its kind: the others are NULL by the table's
# rules).
BY_ID = "\n       AND id = %(delivery_id)s"
EXPECTED = """
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND {cause} = %({cause})s"""
CAUSES = ("cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")


# --- The lease -----------------------------------------------------------------------


# The four conditions of a live lease: claimed, same generation, same target, not
# expired, against each statement's own clock: the one place the rule is written, for
# every statement that acts on a lease (in-process, the API's, the batch's). The
# lease's fields are expressions: by default the parameters ``community_id``,
# ``delivery_id``, ``target_pubkey`` and ``generation``; ``row`` qualifies the
# delivery row's columns (``"d."``) where another relation has columns of those names.
def capability(
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


def live_lease_at_statement(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", **lease: str
) -> str:
    """The capability, still claimed and not expired by the statement's clock."""
    row = lease.get("row", "")
    return f"""{capability(community, target, **lease)}
  AND {row}status = 'claimed' AND {row}lease_until >= statement_timestamp()
"""


def live_lease(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", **lease: str
) -> str:
    """The same, and the community's shared deletion lock, taken before the row."""
    fence = entering_fence(lease.get("row", "") + "community_id")
    return f"{live_lease_at_statement(community, target, **lease)}  AND {fence}\n"


CAPABILITY = capability()
LIVE_LEASE_AT_STATEMENT = live_lease_at_statement()
LIVE_LEASE = live_lease()


def expired_lease(row: str = "") -> str:
    """A lease past its end by the statement's clock and not settled: what the reaper
    takes back (``row`` qualifies the delivery row's columns, as for a live lease)."""
    return f"{row}status = 'claimed' AND {row}lease_until < statement_timestamp()"


def renew_live_lease(community: str = "%(community_id)s", target: str = "%(target_pubkey)s") -> str:
    """A live lease extended to ``lease_seconds`` from now; answers the new lease_until."""
    return f"""UPDATE {DELIVERIES}
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE {live_lease(community, target)}
RETURNING lease_until"""


def settle_live_lease(
    community: str = "%(community_id)s", target: str = "%(target_pubkey)s", *, error: bool = False
) -> str:
    """A live lease settled once: ``outcome``, or with ``error`` failed with the
    holder's error recorded (the ``note`` CTE must come first); answers the status."""
    if error:
        settle = f"status = 'failed', {SETTLE}, {RECORD_ERROR}\n  FROM note"
    else:
        settle = f"status = %(outcome)s, {SETTLE}"
    return f"""UPDATE {DELIVERIES} AS d
   SET {settle}
 WHERE {live_lease(community, target)}
RETURNING d.status"""


def seen_status(community: str, target: str, when: str, **lease: str) -> str:
    """The status of the row the lease's full capability names, read once ``when``
    holds (nothing was settled) with FOR SHARE: a locking read follows a concurrent
    update to its latest committed version, so a retry of a settle sees its terminal
    status where the statement's snapshot would show the row as it was before."""
    held = capability(community, target, row="c.", **lease)
    return f"(SELECT c.status FROM {DELIVERIES} AS c WHERE {when} AND {held} FOR SHARE)"


# The traceback of the error a statement records, for the timeline trigger
# (``wd_record_delivery_transition``), which reads it only for rows whose error that
# statement wrote. Set before any row is written; transaction-local, so in autocommit
# it ends with the statement.
ERROR_NOTE = (
    "note AS MATERIALIZED "
    "(SELECT set_config('workflow_delivery.error_traceback', %(traceback)s, true) AS traceback)"
)
RECORD_ERROR = (
    "last_error_type = %(error_type)s, last_error_message = %(error_message)s, "
    "last_error_at = statement_timestamp()"
)


# A holder's settle and its next claim in one statement, so one commit: ``settled``
# is FINISH's (or FAIL_WITH_ERROR's) settle of the live lease, and the claim's
# ``picked`` is gated on it, so a settle that did not happen claims nothing. The
# held row is claimed, never pending, in the statement's snapshot, so the claim
# cannot pick it. ``community`` and ``target`` name the lease's community and
# target (expressions), ``next_target`` the target whose oldest claimable delivery
# is claimed next; ``error`` settles failed and records the holder's error (the
# ``note`` CTE must come first).
def settle_and_claim(community: str, target: str, next_target: str, *, error: bool) -> str:
    gate = "EXISTS (SELECT 1 FROM settled) AND "
    return f"""settled AS (
{settle_live_lease(community, target, error=error)}
),
{claiming(community, next_target, gate=gate)}"""
