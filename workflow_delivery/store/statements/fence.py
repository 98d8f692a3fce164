"""The community fence's statements: the write check, the state and its exclusive
deletion lock, the executor's presentation, and the purge of a community's rows.
"""

from __future__ import annotations

from ...models import (
    AgentRequestReplay,
    AgentTurn,
    CommunityAgent,
    DeliveryTransition,
    Event,
    IdleWakeTarget,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from ..statement import Statement
from .fragments import COMMUNITIES
from .fragments import quote_name as _q

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
