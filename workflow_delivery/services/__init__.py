"""Every state change of a delivery, one module per audience:

- ``producer``: commit a step's deliveries under its identity lock;
- ``sending``: ``send_message``, the one-call producer built on ``producer``;
- ``holder``: what an agent does with a delivery: claim, renew, finish, retry, give
  back, hold its row for fenced effects, wait idle, read it;
- ``admitted``: the same claim, renew and finish for the signed API, each on a request
  admitted in its own statement;
- ``maintenance``: the reaper's and the prune command's sweeps;
- ``operator``: the admin's bulk release, fail and retry;
- ``replay``: the signed API's request admission and replay guard;
- ``replies``: an agent's reply to a delivery it holds, under its lease;
- ``communities``: create a community, or report the one that has its host;
- ``fence``: the community lifecycle and the deletion executor;
- ``roster``: a community's agent roster: enroll, revoke, reinstate.

Import the functions from here. They own their transaction (or join the caller's),
take the database clock for every time, and return frozen values from ``protocol``.
Expected outcomes (a miss, a lost lease) are values; database rule violations become
named exceptions.
"""

from .admitted import (
    claim_admitted,
    claim_batch_admitted,
    claim_enrolled,
    finish_admitted,
    finish_and_claim_next_admitted,
    renew_admitted,
)
from .communities import create_community
from .fence import (
    PURGE_ATTEMPTS,
    begin_deletion,
    community_write_allowed,
    executor_writes,
    purge_community,
    transition_community,
)
from .holder import (
    MAX_BATCH_SIZE,
    Held,
    checked_lease_seconds,
    claim_deliveries,
    claim_delivery,
    finish_and_claim_next,
    finish_deliveries,
    finish_delivery,
    get_delivery,
    holding,
    keep_agent_turn,
    message_events,
    register_idle,
    release_lease,
    renew_delivery,
    renew_waiting_at_most,
    retry_delivery,
    unregister_idle,
)
from .maintenance import (
    count_prunable,
    prune_cutoff,
    prune_deliveries,
    reap_deliveries,
    reap_expired_deliveries,
)
from .operator import fail_deliveries, release_deliveries, retry_failed_deliveries
from .producer import StepIdentity, commit_deliveries, delivery_identity
from .replay import (
    admit,
    admit_request_event,
    admitted_community,
    prune_replay_guard,
    prune_replay_guard_now_and_then,
)
from .replies import reply_to_delivery, run_replies, send_reply
from .roster import enroll_agent, enroll_agents, reinstate_agent, revoke_agent
from .sending import send_message

__all__ = [
    "MAX_BATCH_SIZE",
    "PURGE_ATTEMPTS",
    "Held",
    "StepIdentity",
    "admit",
    "admit_request_event",
    "admitted_community",
    "begin_deletion",
    "checked_lease_seconds",
    "claim_admitted",
    "claim_batch_admitted",
    "claim_deliveries",
    "claim_delivery",
    "claim_enrolled",
    "commit_deliveries",
    "community_write_allowed",
    "count_prunable",
    "create_community",
    "delivery_identity",
    "enroll_agent",
    "enroll_agents",
    "executor_writes",
    "fail_deliveries",
    "finish_admitted",
    "finish_and_claim_next",
    "finish_and_claim_next_admitted",
    "finish_deliveries",
    "finish_delivery",
    "get_delivery",
    "holding",
    "keep_agent_turn",
    "message_events",
    "prune_cutoff",
    "prune_deliveries",
    "prune_replay_guard",
    "prune_replay_guard_now_and_then",
    "purge_community",
    "reap_deliveries",
    "reap_expired_deliveries",
    "register_idle",
    "reinstate_agent",
    "release_deliveries",
    "release_lease",
    "renew_admitted",
    "renew_delivery",
    "renew_waiting_at_most",
    "reply_to_delivery",
    "retry_delivery",
    "retry_failed_deliveries",
    "revoke_agent",
    "run_replies",
    "send_message",
    "send_reply",
    "transition_community",
    "unregister_idle",
]
