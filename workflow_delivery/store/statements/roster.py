"""The agent roster's statements: enroll, revoke (under the roster's exclusive lock,
with the revoked key's leases released) and reinstate.
"""

from __future__ import annotations

from ...models import CommunityAgent
from ..statement import Statement
from .fragments import AGENTS, BACK_TO_PENDING, DELIVERIES, requiring_write

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
SELECT {requiring_write("%(community_id)s::uuid", "UPDATE", CommunityAgent)},
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
   SET {BACK_TO_PENDING}
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
