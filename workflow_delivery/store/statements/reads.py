"""The read-only statements: metrics, the admin overview's settles per minute, and the
admin's "why not delivered?" page of one (community, target).
"""

from __future__ import annotations

from ..statement import Statement
from .fragments import COMMUNITIES, DELIVERIES, IDLE, TERMINAL, attempts_exhausted

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
  FROM {DELIVERIES} WHERE status IN {TERMINAL} GROUP BY community_id, status
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
# of its settles in that window. An idle registration's session is looked up in
# pg_stat_activity: 'live' when the backend of that pid started when the registration
# says, 'gone' when no backend has the pid or a later one does, 'unseen' when the reading
# role may not see that backend's start (a session of a role it is not a member of).
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
                 AND {attempts_exhausted("%(cap)s", row="")}
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
    SELECT i.registered_at,
           CASE WHEN a.pid IS NULL THEN 'gone'
                WHEN a.backend_start IS NULL THEN 'unseen'
                WHEN a.backend_start = i.backend_start THEN 'live'
                ELSE 'gone'
           END AS session
      FROM {IDLE} AS i
      LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = i.pid
     WHERE i.community_id = %(community)s AND i.target_pubkey = %(target)s
)
SELECT statement_timestamp(), community.host, community.deletion_state,
       pending.total, pending.backing_off, pending.next_at, pending.oldest,
       claimed.total, claimed.expired, claimed.first_expired, claimed.live_until,
       greatest(claimed.last_claimed, claim.last_claimed),
       settled.window_rows, settled.window_since, settled.total, settled.last_settled,
       settled.exhausted,
       error.last_error_type, error.last_error_message, error.last_error_at,
       idle.registered_at, idle.session
  FROM pending
 CROSS JOIN claimed
 CROSS JOIN settled
 CROSS JOIN claim
  LEFT JOIN community ON true
  LEFT JOIN error ON true
  LEFT JOIN idle ON true
""")
