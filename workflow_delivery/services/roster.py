"""A community's agent roster: the keys deliveries may be committed to and the agent
API serves.

The database holds the rules (migration 0016): a delivery whose target is not an
enabled agent of its community cannot be stored (``TargetNotEnrolled``), and the API's
admission reads the signing key's standing. These functions change the roster; each
owns its transaction (or joins the caller's) and is idempotent.

Revoking a key takes the community's roster lock exclusively, after its deletion lock
shared (the order every writer takes them in), so it waits for the commits and the
API requests of the community already past their roster check, then releases every
lease the key holds there: back to pending with the fence bumped, so its late renew
or finish is lease lost. Its pending deliveries stay pending, for the key once it is
reinstated.
"""

from __future__ import annotations

from collections.abc import Iterable
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..exceptions import AgentNotEnrolled, ProtocolError
from ..models import AGENT_LABEL_MAX_LENGTH
from ..protocol import Revocation, RosterEntry, as_bytes32, as_uuid
from ..store import run, statements
from ..validation import checked_operator, checked_public_keys
from ._common import transaction_as

__all__ = ["enroll_agent", "enroll_agents", "reinstate_agent", "revoke_agent"]


def _entry(row: tuple) -> RosterEntry:
    community_id, pubkey, label, enabled, added_at, revoked_at = row
    return RosterEntry(
        community_id=community_id,
        pubkey=bytes(pubkey),
        label=label,
        enabled=enabled,
        added_at=added_at,
        revoked_at=revoked_at,
    )


def _label(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > AGENT_LABEL_MAX_LENGTH or "\x00" in value:
        raise ProtocolError(
            "label", f"must be text of at most {AGENT_LABEL_MAX_LENGTH} characters, not {value!r}"
        )
    return value


def _pubkeys(pubkeys: Iterable[bytes]) -> list[bytes]:
    return sorted(set(checked_public_keys("pubkeys", pubkeys)))


def enroll_agents(
    community_id: UUID | str,
    pubkeys: Iterable[bytes],
    *,
    label: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[RosterEntry]:
    """Enroll keys as enabled agents of the community; returns their entries (by key).
    A key already enrolled keeps its standing (a revoked one stays revoked: see
    ``reinstate_agent``) and takes ``label`` if one is given. An unknown community
    raises ``CommunityNotFound``, one that is not active ``CommunityWriteFenced``."""
    community_id = as_uuid("community_id", community_id)
    keys = _pubkeys(pubkeys)
    label = _label(label)
    if not keys:
        return []
    rows = run.fetch(
        using,
        statements.ENROLL_AGENTS,
        {"community_id": community_id, "label": label, "pubkeys": keys},
    )
    return sorted((_entry(row) for row in rows), key=lambda entry: entry.pubkey)


def enroll_agent(
    community_id: UUID | str,
    pubkey: bytes,
    *,
    label: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> RosterEntry:
    """Enroll one key (``enroll_agents``); returns its entry."""
    (entry,) = enroll_agents(community_id, [as_bytes32("pubkey", pubkey)], label=label, using=using)
    return entry


def _scope(community_id: UUID | str, pubkey: bytes) -> tuple[UUID, bytes]:
    return as_uuid("community_id", community_id), as_bytes32("pubkey", pubkey)


def _not_enrolled(community_id: UUID, pubkey: bytes) -> AgentNotEnrolled:
    return AgentNotEnrolled(f"{pubkey.hex()} is not an agent of community {community_id}")


def revoke_agent(
    community_id: UUID | str,
    pubkey: bytes,
    *,
    operator: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Revocation:
    """Revoke an agent: the API refuses its requests (``auth_revoked``), no delivery can
    be committed to it, and every lease it holds in the community is released (the
    timeline records the release by ``operator:<operator>``). Revoking it again keeps
    the first revocation's time and releases whatever it holds by then. A key not in
    the roster raises ``AgentNotEnrolled``; a community that is not active,
    ``CommunityWriteFenced``; nothing is changed by either."""
    community_id, pubkey = _scope(community_id, pubkey)
    actor = "operator" if operator is None else f"operator:{checked_operator(operator)}"
    # One transaction: the roster lock is held until the revocation and the release
    # of the key's leases commit together.
    with transaction_as(actor, using):
        key = {"community_id": community_id, "pubkey": pubkey}
        run.fetch(using, statements.LOCK_ROSTER_EXCLUSIVE, key, savepoint=False)
        revoked = run.fetch(using, statements.REVOKE_AGENT, key, savepoint=False)
        if not revoked:
            raise _not_enrolled(community_id, pubkey)
        (row,) = revoked
        leases = run.fetch(using, statements.RELEASE_AGENT_LEASES, key, savepoint=False)
        released = tuple(sorted(found for (found,) in leases))
    return Revocation(entry=_entry(row), released=released)


def reinstate_agent(
    community_id: UUID | str, pubkey: bytes, *, using: str = DEFAULT_DB_ALIAS
) -> RosterEntry:
    """Enable a revoked agent again (an enabled one is left as it is); returns its entry.
    A key not in the roster raises ``AgentNotEnrolled``."""
    community_id, pubkey = _scope(community_id, pubkey)
    rows = run.fetch(
        using, statements.REINSTATE_AGENT, {"community_id": community_id, "pubkey": pubkey}
    )
    if not rows:
        raise _not_enrolled(community_id, pubkey)
    return _entry(rows[0])
