"""Rows decoded into the app's values, each beside the column list it reads.

A delivery row is read as ``RECORD_COLUMNS`` (by the statements that return a
record, and by the ORM's ``values_list``) and decoded by ``record``; a binding's
cause is written as ``cause_columns``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol import (
    DeliveryBinding,
    DeliveryRecord,
    EventCause,
    RecordedError,
    ScheduleCause,
    WebhookCause,
    stored_binding,
    stored_cause,
    stored_status,
)

# Columns of a delivery record, in the order ``record`` reads them. The first
# thirteen are the ones a producer writes.
RECORD_COLUMNS = [
    "id",
    "community_id",
    "workflow_id",
    "run_id",
    "step_id",
    "target_pubkey",
    "definition_event_id",
    "message_event_id",
    "message_event_created_at",
    "cause_kind",
    "cause_event_id",
    "cause_scheduled_for",
    "cause_webhook_invocation_id",
    "status",
    "lease_generation",
    "lease_until",
    "claimed_at",
    "finished_at",
    "created_at",
    "attempts",
    "available_at",
    "last_error_type",
    "last_error_message",
    "last_error_at",
]


def cause_columns(binding: DeliveryBinding) -> list[object]:
    """The binding's cause as its four stored columns: kind, event id, scheduled
    time, webhook invocation id (the last three NULL but the kind's)."""
    cause = binding.cause
    return [
        cause.kind.value,
        cause.event_id if isinstance(cause, EventCause) else None,
        cause.scheduled_for if isinstance(cause, ScheduleCause) else None,
        cause.invocation_id if isinstance(cause, WebhookCause) else None,
    ]


def record(row: Sequence) -> DeliveryRecord:
    """The record of a row read as ``RECORD_COLUMNS``. Its fields are taken as stored,
    not re-validated one by one: the table's own rules already hold them."""
    (
        id_,
        community_id,
        workflow_id,
        run_id,
        step_id,
        target_pubkey,
        definition_event_id,
        message_event_id,
        message_event_created_at,
        cause_kind,
        cause_event_id,
        cause_scheduled_for,
        cause_webhook_invocation_id,
        status,
        lease_generation,
        lease_until,
        claimed_at,
        finished_at,
        created_at,
        attempts,
        available_at,
        last_error_type,
        last_error_message,
        last_error_at,
    ) = row
    binding = stored_binding(
        community_id,
        workflow_id,
        run_id,
        step_id,
        target_pubkey,
        definition_event_id,
        message_event_id,
        stored_cause(cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id),
    )
    return DeliveryRecord(
        id_,
        binding,
        stored_status(status),
        lease_generation,
        lease_until,
        claimed_at,
        finished_at,
        created_at,
        message_event_created_at,
        attempts,
        available_at,
        None
        if last_error_type is None
        else RecordedError(last_error_type, last_error_message, last_error_at),
    )
