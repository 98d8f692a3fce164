"""Maintenance's statements: the timeline's actor and switch, the fleet-wide reaper,
the operator's release, mark failed and retry, and retention (deliveries and replay
guards).
"""

from __future__ import annotations

from functools import lru_cache

from ...validation import is_whole_number
from ..statement import Statement
from .fragments import (
    BACK_TO_PENDING,
    COMMUNITIES,
    DELIVERIES,
    FENCE_BUMP,
    REPLAYS,
    SETTLE,
    TERMINAL,
    TIMELINE,
    attempt_ended,
    expired_lease,
    open_once_tried,
    trying_fence,
)

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
# Whether the session's timeline is on (``SET_TIMELINE``).
_TIMELINE_ON = "current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'"
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
     WHERE {_TIMELINE_ON}
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
    2. ``tried``: the shared deletion lock of each, *tried* (``trying_fence``): a
       community whose exclusive lock is held or queued for (a transition, a purge)
       is skipped for this sweep and reported, never waited on.
    3. ``open``: the locked ones still active by a fresh look (``open_once_tried``:
       community_write_allowed, after the lock, so a transition that committed
       meanwhile is seen and no row of a fenced tenant reaches the fence trigger to
       abort the batch).
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
    most = f"{'NULL' if cap is None else str(int(cap))}::integer"
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
            WHERE r.community_id = c.id AND {expired_lease("r.")}
            ORDER BY r.lease_until LIMIT 1
              FOR UPDATE OF r SKIP LOCKED
     ) AS e
     WHERE c.deletion_state = 'active'
     ORDER BY e.oldest
     LIMIT {limit}
),
tried AS MATERIALIZED (
    SELECT id, oldest, {trying_fence("id")} AS locked
      FROM candidates
),
open AS MATERIALIZED (
    SELECT id FROM tried WHERE {open_once_tried("locked", "id")}
),
expired AS (
    SELECT d.id, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM {DELIVERIES} AS d
     WHERE d.id IN (
           SELECT x.id FROM open
            CROSS JOIN LATERAL (
                  SELECT r.id, r.lease_until FROM {DELIVERIES} AS r
                   WHERE r.community_id = open.id AND {expired_lease("r.")}
                   ORDER BY r.lease_until LIMIT {limit}
                     FOR UPDATE OF r SKIP LOCKED
            ) AS x
            ORDER BY x.lease_until LIMIT {limit}
     )
       AND {expired_lease("d.")}
       FOR UPDATE OF d SKIP LOCKED
),
moved AS (
    UPDATE {DELIVERIES} AS d
       SET {attempt_ended(most)}
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


# Whether an operator's statement may write the community (``open_once_tried``: its
# shared deletion lock tried, not waited for, and its write fence open), and whether
# the timeline records.
_COMMUNITY = "%(community_id)s::uuid"
_OPERABLE = f"""operable AS MATERIALIZED (
    SELECT {open_once_tried(trying_fence(_COMMUNITY), _COMMUNITY)} AS ok,
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
RELEASE = _operator_statement("'claimed'", BACK_TO_PENDING, "released")

# An operator's terminal for chosen non-terminal rows (admin), recorded as failed. The
# generation is bumped too, so a live holder's finish gets LeaseLost rather than an
# AlreadyTerminal it could mistake for its own earlier settle.
MARK_FAILED = _operator_statement(
    "'pending', 'claimed'",
    f"status = 'failed', {FENCE_BUMP}, {SETTLE}, available_at = NULL",
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
       SET status = 'pending', {FENCE_BUMP},
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
     WHERE {_TIMELINE_ON}
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
     WHERE d.status IN {TERMINAL} AND d.finished_at <= %(cutoff)s
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
 WHERE c.deletion_state = 'active' AND d.status IN {TERMINAL}
   AND d.finished_at <= %(cutoff)s
 GROUP BY c.id, c.host ORDER BY c.host
""")

# One bounded batch of replay-guard pruning across communities: only rows whose
# event can no longer pass the freshness window, only in active communities whose
# deletion lock is free right now (``trying_fence``: a tenant being deleted is
# skipped, never waited for; its purge removes its rows).
PRUNE_REPLAYS_BATCH = Statement(f"""
WITH open AS (
    SELECT id FROM {COMMUNITIES}
     WHERE deletion_state = 'active'
       AND {trying_fence("id")}
), doomed AS (
    SELECT r.id FROM {REPLAYS} AS r
     WHERE r.event_created_at < now() - make_interval(secs => %(horizon)s)
       AND r.community_id IN (SELECT id FROM open)
     LIMIT %(limit)s
     FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM {REPLAYS} AS r USING doomed WHERE r.id = doomed.id
""")
