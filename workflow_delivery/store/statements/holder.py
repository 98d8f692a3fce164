"""The holder's statements: the idle registry, the claim in every shape, and what a
holder does with its lease (renew, finish, retry, fail, settle and claim the next,
release, hold), the turn it keeps and the messages it reads.

Built from ``fragments``: the claim's, the live-lease rule's, the settle's.
"""

from __future__ import annotations

from ..statement import Statement
from .fragments import (
    AGENT_TURNS,
    BACK_TO_PENDING,
    BY_ID,
    CAPABILITY,
    CAUSES,
    CLAIM_PICKED,
    CLAIMED_RECORD,
    DELIVERIES,
    ERROR_NOTE,
    EVENTS,
    EXPECTED,
    IDLE,
    LIVE_LEASE,
    LIVE_LEASE_AT_STATEMENT,
    RECORD_ERROR,
    SETTLE,
    STAMP,
    attempt_ended,
    attempts_exhausted,
    live_lease,
    picked,
    renew_live_lease,
    seen_status,
    settle_and_claim,
    settle_live_lease,
)

# A consumer with nothing to claim registers its targets as idle, once it listens and
# before its last poll, naming the session its wake-up goes to (``pid`` and
# ``backend_start``: its listener's, or else the registering session's own). Registering
# again renews the registration: its session and time are the latest registrant's.
REGISTER_IDLE = Statement(f"""
INSERT INTO {IDLE} (community_id, target_pubkey, pid, backend_start)
SELECT %(community_id)s::uuid, t, s.pid, s.backend_start
  FROM unnest(%(target_pubkeys)s::bytea[]) AS t,
       (SELECT coalesce(%(pid)s::integer, a.pid) AS pid,
               coalesce(%(backend_start)s::timestamptz, a.backend_start) AS backend_start
          FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a) AS s
ON CONFLICT (community_id, target_pubkey) DO UPDATE
   SET pid = excluded.pid, backend_start = excluded.backend_start,
       registered_at = excluded.registered_at
""")

# A consumer that stops cleanly takes its targets' registrations back: nothing of it
# waits for a wake-up any more.
UNREGISTER_IDLE = Statement(f"""
DELETE FROM {IDLE}
 WHERE community_id = %(community_id)s::uuid
   AND target_pubkey = ANY(%(target_pubkeys)s::bytea[])
""")


def _claim(match: str = "", limit: str = "1") -> Statement:
    """The claim of up to ``limit`` of a target's oldest pending rows that also meet
    ``match`` (``picked``), as the statement itself: ``claiming``'s CTEs with the
    update of the winners as the main statement. Parameters: ``community_id``, ``target_pubkey``,
    ``lease_seconds``, and ``match``'s."""
    rows = picked("%(community_id)s", "%(target_pubkey)s", match, limit)
    return Statement(f"""
WITH {rows},
{STAMP}
{CLAIM_PICKED}
""")


# The single claim, in the shapes its callers use (``BY_ID``, ``EXPECTED``).
CLAIM = _claim()
CLAIM_BY_ID = _claim(BY_ID)
CLAIM_EXPECTED = {cause: _claim(EXPECTED.format(cause=cause)) for cause in CAUSES}
CLAIM_BY_ID_EXPECTED = {cause: _claim(BY_ID + EXPECTED.format(cause=cause)) for cause in CAUSES}

# Batch claim: up to ``limit`` of the target's oldest pending rows in one statement,
# each with its own (incremented) generation, stamped as the single claim is.
CLAIM_BATCH = _claim(limit="%(limit)s")

# The lease renewed and settled by its holder, under the live-lease rule.
RENEW = Statement(f"\n{renew_live_lease()}\n")

FINISH = Statement(f"\n{settle_live_lease()}\n")

# After a finish that settled nothing: the row as the caller's full capability sees it.
STATUS_BY_CAPABILITY = Statement(f"SELECT status FROM {DELIVERIES} WHERE {CAPABILITY}")

# Batch finish: the leases arrive as parallel arrays (community, id, target,
# generation, outcome), one element per distinct capability. Each row settles under
# the live-lease rule as FINISH's; for a capability that settled nothing, the row as
# that capability sees it (``seen_status``).
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
       SET status = l.outcome, {SETTLE}
      FROM leases AS l
     WHERE {live_lease("l.community_id", "l.target_pubkey", row="d.", **_BATCH_LEASE)}
    RETURNING l.n
)
SELECT l.n, s.n IS NOT NULL,
       {seen_status("l.community_id", "l.target_pubkey", "s.n IS NULL", **_BATCH_LEASE)}
  FROM leases AS l LEFT JOIN settled AS s ON s.n = l.n
""")

# A holder's failed attempt, in one statement under the four conditions of a live
# lease: back to pending with the fence bumped, the error kept, and no claim before
# ``available_at``; or, once the delivery has used every attempt (the cap, NULL for
# none), settled failed as the reaper settles such a lease. The wait is the caller's
# delay if given, else min(most, base * 2^(attempts - 1)) times a random factor from
# 0.5 to 1, so retries of many deliveries that failed together spread out.
_EXHAUSTED = attempts_exhausted("p.cap")
RETRY = Statement(f"""
WITH {ERROR_NOTE}
UPDATE {DELIVERIES} AS d
   SET {attempt_ended("p.cap")},
       available_at = CASE WHEN {_EXHAUSTED} THEN NULL
           ELSE statement_timestamp() + make_interval(secs => coalesce(
               p.delay,
               least(p.most, p.base * power(2::float8, least(greatest(d.attempts - 1, 0), 60)))
               * (0.5 + random() / 2)))
       END,
       {RECORD_ERROR}
  FROM note, (SELECT %(cap)s::integer AS cap, %(delay)s::float8 AS delay,
                     %(base)s::float8 AS base, %(most)s::float8 AS most) AS p
 WHERE {LIVE_LEASE}
RETURNING d.status, d.available_at, d.attempts
""")

# A holder's own failure, with its error: FINISH's settle, recording the error too.
FAIL_WITH_ERROR = Statement(f"""
WITH {ERROR_NOTE}
{settle_live_lease(error=True)}
""")


def _finish_and_claim_next(*, error: bool) -> Statement:
    """The holder's settle-and-claim. Answers one row: the status settled (NULL when
    nothing was), the status the lease's full capability sees when nothing was
    settled (read FOR SHARE, so the latest committed version: a retry of a settle
    sees its terminal status, as FINISH's follow-up statement would), then the
    claimed record's columns (NULL when nothing was claimed). Parameters: the
    lease's, ``outcome`` (or, with ``error``, ``traceback``, ``error_type``,
    ``error_message``), ``next_target_pubkey``, ``lease_seconds``."""
    operation = settle_and_claim(
        "%(community_id)s", "%(target_pubkey)s", "%(next_target_pubkey)s", error=error
    )
    note = f"{ERROR_NOTE},\n" if error else ""
    return Statement(f"""
WITH {note}{operation}
SELECT s.status,
       {seen_status("%(community_id)s", "%(target_pubkey)s", "s.status IS NULL")},
       {CLAIMED_RECORD}
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
   SET {BACK_TO_PENDING}
 WHERE {LIVE_LEASE}
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
SELECT lease_until FROM {DELIVERIES} WHERE {LIVE_LEASE}   FOR UPDATE
""")

# Asked once the lock is ours, and again before an unfinished block commits: the
# lease may have run out meanwhile, and nobody else can change the row now.
HELD_LIVE = Statement(f"SELECT lease_until FROM {DELIVERIES} WHERE {LIVE_LEASE_AT_STATEMENT}")

HELD_FINISH = Statement(f"""
UPDATE {DELIVERIES}
   SET status = %(outcome)s, {SETTLE}
 WHERE {LIVE_LEASE_AT_STATEMENT}
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
 WHERE {LIVE_LEASE}  AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true)) IS NOT NULL
RETURNING lease_until
""")
