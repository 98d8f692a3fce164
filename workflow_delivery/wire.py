"""The JSON shape of the protocol's values on the wire, both ways; no Django, no I/O,
so the client shares it with the server.

Bytes are lowercase hex, ids canonical lowercase UUID strings, times ISO 8601 UTC
with every digit the database gave (``Z`` suffix). A message's content is a JSON
string when its ``content_kind`` is ``text``, any JSON value when it is ``json``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

from .exceptions import ProtocolError
from .protocol import (
    Cause,
    ContentKind,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    EventCause,
    Lease,
    MessageEvent,
    RecordedError,
    ScheduleCause,
    WebhookCause,
)

__all__ = [
    "binding_document",
    "cause_document",
    "delivery_document",
    "instant",
    "lease_document",
    "message_document",
    "parse_delivery",
    "parse_instant",
    "parse_lease",
    "parse_message",
]


def instant(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_instant(value: str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value)


def cause_document(cause: Cause) -> dict[str, str]:
    if isinstance(cause, EventCause):
        return {"kind": "event", "event_id": cause.event_id.hex()}
    if isinstance(cause, ScheduleCause):
        return {"kind": "schedule", "scheduled_for": instant(cause.scheduled_for)}
    return {"kind": "webhook", "invocation_id": str(cause.invocation_id)}


def _parse_cause(document: dict[str, str]) -> Cause:
    kind = document.get("kind")
    if kind == "event":
        return EventCause(bytes.fromhex(document["event_id"]))
    if kind == "schedule":
        return ScheduleCause(parse_instant(document["scheduled_for"]))
    if kind == "webhook":
        return WebhookCause(document["invocation_id"])
    raise ProtocolError("cause", f"unknown cause kind {kind!r}")


def binding_document(binding: DeliveryBinding) -> dict[str, object]:
    return {
        "community_id": str(binding.community_id),
        "workflow_id": str(binding.workflow_id),
        "run_id": str(binding.run_id),
        "step_id": binding.step_id,
        "target_pubkey": binding.target_pubkey.hex(),
        "definition_event_id": binding.definition_event_id.hex(),
        "message_event_id": binding.message_event_id.hex(),
        "cause": cause_document(binding.cause),
    }


def delivery_document(
    record: DeliveryRecord, *, message: MessageEvent | None = None
) -> dict[str, object]:
    """The record as the API answers it; ``message``, for its target, as well."""
    document = {"id": str(record.id), **binding_document(record.binding)}
    document.update(
        message_event_created_at=instant(record.message_event_created_at),
        status=record.status.value,
        lease_generation=record.lease_generation,
        lease_until=instant(record.lease_until),
        claimed_at=instant(record.claimed_at),
        finished_at=instant(record.finished_at),
        created_at=instant(record.created_at),
        attempts=record.attempts,
        available_at=instant(record.available_at),
        last_error=_error_document(record.last_error),
    )
    if message is not None:
        document["message"] = message_document(message)
    return document


def message_document(message: MessageEvent) -> dict[str, object]:
    return {
        "id": message.id.hex(),
        "pubkey": message.pubkey.hex(),
        "created_at": instant(message.created_at),
        "kind": message.kind,
        "tags": message.tags,
        "content_kind": message.content_kind.value,
        "content": message.content,
    }


def parse_message(document: dict | None) -> MessageEvent | None:
    if document is None:
        return None
    return MessageEvent(
        id=bytes.fromhex(document["id"]),
        pubkey=bytes.fromhex(document["pubkey"]),
        created_at=parse_instant(document["created_at"]),
        kind=document["kind"],
        tags=document["tags"],
        content=document["content"],
        # Absent from a server whose messages are text only.
        content_kind=ContentKind(document.get("content_kind", "text")),
    )


def _error_document(error: RecordedError | None) -> dict[str, object] | None:
    if error is None:
        return None
    return {"type": error.type, "message": error.message, "at": instant(error.at)}


def _parse_error(document: dict | None) -> RecordedError | None:
    if document is None:
        return None
    return RecordedError(document["type"], document["message"], parse_instant(document["at"]))


def parse_delivery(document: dict) -> DeliveryRecord:
    binding = DeliveryBinding(
        community_id=UUID(document["community_id"]),
        workflow_id=UUID(document["workflow_id"]),
        run_id=UUID(document["run_id"]),
        step_id=document["step_id"],
        target_pubkey=bytes.fromhex(document["target_pubkey"]),
        definition_event_id=bytes.fromhex(document["definition_event_id"]),
        message_event_id=bytes.fromhex(document["message_event_id"]),
        cause=_parse_cause(document["cause"]),
    )
    return DeliveryRecord(
        id=UUID(document["id"]),
        binding=binding,
        status=DeliveryStatus(document["status"]),
        lease_generation=document["lease_generation"],
        lease_until=parse_instant(document["lease_until"]),
        claimed_at=parse_instant(document["claimed_at"]),
        finished_at=parse_instant(document["finished_at"]),
        created_at=parse_instant(document["created_at"]),
        message_event_created_at=parse_instant(document["message_event_created_at"]),
        # Absent from a server that predates retries.
        attempts=document.get("attempts", 0),
        available_at=parse_instant(document.get("available_at")),
        last_error=_parse_error(document.get("last_error")),
    )


def lease_document(lease: Lease) -> dict[str, object]:
    return {
        "community_id": str(lease.community_id),
        "delivery_id": str(lease.delivery_id),
        "target_pubkey": lease.target_pubkey.hex(),
        "generation": lease.generation,
        "lease_until": instant(lease.lease_until),
    }


def parse_lease(document: dict) -> Lease:
    return Lease(
        community_id=UUID(document["community_id"]),
        delivery_id=UUID(document["delivery_id"]),
        target_pubkey=bytes.fromhex(document["target_pubkey"]),
        generation=document["generation"],
        lease_until=parse_instant(document["lease_until"]),
    )
