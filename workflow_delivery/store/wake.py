"""The wake-up channel and its payload: the name producers NOTIFY on and listeners
LISTEN on, and the payload's one text form (``<community uuid>:<target hex>:<delivery
uuid>``, identifiers only, never content), written by ``format_wake`` (and by the
producer's statement in SQL, ``statements._WAKE_IDLE``) and read back by ``parse_wake``.
The session that listens is ``wakeups.WakeListener``, above the store."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

__all__ = ["WAKE_CHANNEL", "WakeNotice", "format_wake", "parse_wake"]

WAKE_CHANNEL = "workflow_delivery_wake"

_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class WakeNotice:
    """A notification's identifiers: a delivery for this target was committed.

    Not ``protocol.WakeHint`` (the signed kind-24620 event an agent may receive): this
    one comes from the database and names the community too.
    """

    community_id: UUID
    target_pubkey: bytes
    delivery_id: UUID


@dataclass(frozen=True, slots=True)
class ListenerSession:
    """A database session as ``pg_stat_activity`` names it: ``pid`` alone may be reused
    by a later backend, ``(pid, backend_start)`` may not."""

    pid: int
    backend_start: datetime


def format_wake(community_id: UUID | str, target_pubkey: bytes, delivery_id: UUID | str) -> str:
    """The payload of one wake-up (``store.statements._WAKE_IDLE`` builds the same text in SQL)."""
    if not isinstance(community_id, UUID):
        community_id = UUID(str(community_id))
    if not isinstance(delivery_id, UUID):
        delivery_id = UUID(str(delivery_id))
    return f"{community_id}:{bytes(target_pubkey).hex()}:{delivery_id}"


def _canonical_uuid(text: str) -> UUID | None:
    if len(text) != 36:
        return None
    try:
        value = UUID(text)
    except ValueError:
        return None
    return value if str(value) == text else None


def parse_wake(payload: object) -> WakeNotice | None:
    """A payload's hint, or None when it is not exactly the producer's format."""
    if not isinstance(payload, str):
        return None
    parts = payload.split(":")
    if len(parts) != 3:
        return None
    community, target, delivery = parts
    if len(target) != 64 or not _HEX.issuperset(target):
        return None
    community_id, delivery_id = _canonical_uuid(community), _canonical_uuid(delivery)
    if community_id is None or delivery_id is None:
        return None
    return WakeNotice(community_id, bytes.fromhex(target), delivery_id)
