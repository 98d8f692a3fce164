"""The API's request and answer documents (pydantic, through django-ninja), and the
conversions between them and the protocol's values.

Bytes travel as lowercase hex, ids as canonical lowercase UUID strings, times as
ISO 8601 UTC strings exactly as the database returned them (microseconds kept).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import AwareDatetime, ConfigDict, Field, StrictBool, StrictInt

from ..protocol import (
    STEP_ID_MAX_LENGTH,
    Cause,
    DeliveryBinding,
    EventCause,
    ScheduleCause,
    WebhookCause,
)
from ..validation import LEASE_SECONDS_BOUND

UUID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
HEX32_PATTERN = r"^[0-9a-f]{64}$"
BIGINT_MAX = 2**63 - 1
# The longest reason a settle or a retry sends (the stored message is cut shorter).
ERROR_TEXT_MAX = 4000
# The longest idempotency key of a reply.
MAX_REPLY_KEY = 200
# A turn's tool calls and permission requests kept at most, and the longest string of one.
TURN_ENTRIES_MAX = 200
TURN_FIELD_MAX = 300
# The most agents one reply is sent to (one statement commits its deliveries).
MAX_REPLY_TARGETS = 1000

Uuid = Annotated[str, Field(pattern=UUID_PATTERN, description="canonical lowercase UUID")]
Hex32 = Annotated[str, Field(pattern=HEX32_PATTERN, description="32 bytes as lowercase hex")]
Instant = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
ErrorText = Annotated[str, Field(min_length=1, max_length=ERROR_TEXT_MAX)]
LeaseSeconds = Annotated[StrictInt, Field(ge=1, le=BIGINT_MAX)]
Generation = Annotated[StrictInt, Field(ge=0, le=BIGINT_MAX)]


class _Strict(Schema):
    model_config = ConfigDict(extra="forbid")


class EventCauseIn(_Strict):
    kind: Literal["event"]
    event_id: Hex32


class ScheduleCauseIn(_Strict):
    kind: Literal["schedule"]
    scheduled_for: AwareDatetime


class WebhookCauseIn(_Strict):
    kind: Literal["webhook"]
    invocation_id: Uuid


CauseIn = Annotated[EventCauseIn | ScheduleCauseIn | WebhookCauseIn, Field(discriminator="kind")]


class BindingIn(_Strict):
    community_id: Uuid
    workflow_id: Uuid
    run_id: Uuid
    step_id: Annotated[str, Field(min_length=1, max_length=STEP_ID_MAX_LENGTH)]
    target_pubkey: Hex32
    definition_event_id: Hex32
    message_event_id: Hex32
    cause: CauseIn

    def binding(self) -> DeliveryBinding:
        """The protocol's binding (its constructor names any field it refuses)."""
        cause = self.cause
        if isinstance(cause, EventCauseIn):
            value: Cause = EventCause(bytes.fromhex(cause.event_id))
        elif isinstance(cause, ScheduleCauseIn):
            value = ScheduleCause(cause.scheduled_for)
        else:
            value = WebhookCause(cause.invocation_id)
        return DeliveryBinding(
            community_id=self.community_id,
            workflow_id=self.workflow_id,
            run_id=self.run_id,
            step_id=self.step_id,
            target_pubkey=bytes.fromhex(self.target_pubkey),
            definition_event_id=bytes.fromhex(self.definition_event_id),
            message_event_id=bytes.fromhex(self.message_event_id),
            cause=value,
        )


class ClaimIn(_Strict):
    lease_seconds: LeaseSeconds | None = None
    delivery_id: Uuid | None = None
    expected: BindingIn | None = None
    wait: Annotated[StrictInt, Field(ge=0, le=60)] | None = Field(
        None,
        description=(
            "seconds (0-60) to wait for a claimable delivery when there is none yet; "
            "only for a claim that names no delivery and no expected binding"
        ),
    )


class RenewIn(_Strict):
    generation: Generation
    lease_seconds: LeaseSeconds | None = None


Clipped = Annotated[str, Field(max_length=TURN_FIELD_MAX)]


class ToolCallIn(_Strict):
    id: Clipped
    title: Clipped | None = None
    kind: Clipped | None = None
    status: Clipped | None = None


class PermissionIn(_Strict):
    title: Clipped
    kind: Clipped
    options: Annotated[list[Clipped], Field(max_length=10)] = []
    answer: Literal["allowed", "denied"]
    option: Clipped | None = None


class TurnIn(_Strict):
    """What an ACP agent said in the turn of this attempt, stored with the settle."""

    text: str = Field(
        description="its streamed text, at most WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES bytes"
    )
    said_bytes: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = Field(
        description="the bytes it said in all (more than `text` holds when that was cut)"
    )
    stop_reason: Annotated[str, Field(max_length=100)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=TURN_ENTRIES_MAX)] = []
    permissions: Annotated[list[PermissionIn], Field(max_length=TURN_ENTRIES_MAX)] = []


_TURN = (
    "what the agent said in the turn of this attempt, stored with the settle in its "
    "transaction (shown on the delivery's admin page); not with `next`"
)


class FinishIn(_Strict):
    generation: Generation
    outcome: Literal["finished", "failed"]
    next: StrictBool = Field(
        False,
        description=(
            "also claim the caller's oldest claimable delivery, in the same statement as "
            "the settle; answered as `next` (null when there is none)"
        ),
    )
    lease_seconds: LeaseSeconds | None = Field(
        None, description="the lease of the delivery claimed with `next`"
    )
    error: ErrorText | None = Field(
        None,
        description=(
            "only with `failed` (and without `next`): the reason, kept as the delivery's "
            "last error; a failure for good, never retried"
        ),
    )
    turn: TurnIn | None = Field(None, description=_TURN)


class RetryIn(_Strict):
    generation: Generation
    error: ErrorText = Field(description="why the attempt failed, kept as the last error")
    delay_seconds: Annotated[float, Field(ge=0, le=LEASE_SECONDS_BOUND)] | None = Field(
        None,
        description=(
            "seconds before the delivery may be claimed again; by default the server's "
            "backoff, growing with the attempts used"
        ),
    )
    turn: TurnIn | None = Field(None, description=_TURN)


class RetryOut(Schema):
    result: Literal["retried", "exhausted"] = Field(
        description=(
            "`retried`: pending again from `available_at`; `exhausted`: every attempt "
            "is used, the delivery settled failed"
        )
    )
    attempts: int
    available_at: Instant | None = None


class ReleaseIn(_Strict):
    generation: Generation


class ReleaseOut(Schema):
    result: Literal["released"]


class ReplyIn(_Strict):
    generation: Generation
    content: Annotated[str, Field(min_length=1)] = Field(
        description="the reply's text (at most WORKFLOW_DELIVERY_ACP_REPLY_BYTES bytes)"
    )
    to: Annotated[list[Hex32], Field(min_length=1, max_length=MAX_REPLY_TARGETS)] = Field(
        description="the enrolled agents the reply is delivered to"
    )
    idempotency_key: Annotated[str, Field(min_length=1, max_length=MAX_REPLY_KEY)] = Field(
        description="the same key for the same delivery sends once"
    )


class ReplyOut(Schema):
    message_id: Hex32
    run_id: Uuid
    step_id: str
    created: bool = Field(description="false: this key's reply was already sent")
    deliveries: list[Uuid]


class ReplyItemOut(Schema):
    id: Hex32
    content: str
    pubkey: Hex32


class RepliesOut(Schema):
    run_id: Uuid
    replies: list[ReplyItemOut]


class EventCauseOut(Schema):
    kind: Literal["event"]
    event_id: Hex32


class ScheduleCauseOut(Schema):
    kind: Literal["schedule"]
    scheduled_for: Instant


class WebhookCauseOut(Schema):
    kind: Literal["webhook"]
    invocation_id: Uuid


CauseOut = Annotated[
    EventCauseOut | ScheduleCauseOut | WebhookCauseOut, Field(discriminator="kind")
]


# The most deliveries one batch request claims or settles.
API_BATCH_MAX = 100


class ClaimBatchIn(_Strict):
    limit: Annotated[StrictInt, Field(ge=1, le=API_BATCH_MAX)]
    lease_seconds: LeaseSeconds | None = None


class SettlementIn(_Strict):
    delivery_id: Uuid
    generation: Generation
    outcome: Literal["finished", "failed"]


class FinishBatchIn(_Strict):
    settlements: Annotated[list[SettlementIn], Field(min_length=1, max_length=API_BATCH_MAX)]


class MessageOut(Schema):
    id: Hex32
    pubkey: Hex32
    created_at: Instant
    kind: int
    tags: list[list[str]]
    content_kind: Literal["text", "json"] = Field(
        description="what `content` is: `text`, a string; `json`, a JSON value"
    )
    # Any JSON value (the schema names no type); answered as the producer stored it.
    content: Any = Field(
        description="the message's text when `content_kind` is `text`; when it is `json`, "
        "the JSON value the producer sent: an object, array, string, number, boolean or null"
    )


class LastErrorOut(Schema):
    type: str
    message: str
    at: Instant


class DeliveryOut(Schema):
    id: Uuid
    community_id: Uuid
    workflow_id: Uuid
    run_id: Uuid
    step_id: str
    target_pubkey: Hex32
    definition_event_id: Hex32
    message_event_id: Hex32
    message_event_created_at: Instant
    cause: CauseOut
    status: Literal["pending", "claimed", "finished", "failed"]
    lease_generation: int
    lease_until: Instant | None
    claimed_at: Instant | None
    finished_at: Instant | None
    created_at: Instant
    message: MessageOut | None = Field(
        None, description="the message event, answered to the delivery's target only"
    )
    attempts: int = 0
    available_at: Instant | None = None
    last_error: LastErrorOut | None = None


class LeaseOut(Schema):
    community_id: Uuid
    delivery_id: Uuid
    target_pubkey: Hex32
    generation: int
    lease_until: Instant


class ClaimOut(Schema):
    lease: LeaseOut
    delivery: DeliveryOut


class ClaimBatchOut(Schema):
    claimed: list[ClaimOut]


class RenewOut(Schema):
    lease_until: Instant


_NEXT = "with `next`: the delivery claimed with the settle and its lease, or null"


class SettledOut(Schema):
    result: Literal["settled"]
    outcome: Literal["finished", "failed"]
    next: ClaimOut | None = Field(None, description=_NEXT)


class AlreadyTerminalOut(Schema):
    result: Literal["already_terminal"]
    status: Literal["finished", "failed"]
    next: ClaimOut | None = Field(None, description=_NEXT + " (a retry claims nothing)")


FinishOut = Annotated[SettledOut | AlreadyTerminalOut, Field(discriminator="result")]


class SettlementOut(Schema):
    delivery_id: Uuid
    result: Literal["settled", "already_terminal", "lease_lost"]
    outcome: Literal["finished", "failed"] | None = None
    status: Literal["finished", "failed"] | None = None


class FinishBatchOut(Schema):
    results: list[SettlementOut]


class WakeOut(Schema):
    delivery_id: Uuid
    target: Hex32


class ErrorOut(Schema):
    error: str = Field(
        description=(
            "A stable code. A 401 names the refusal: auth_missing, auth_malformed, "
            "auth_wrong_kind, auth_bad_id, auth_bad_signature, auth_url_mismatch, "
            "auth_method_mismatch, auth_payload_missing, auth_payload_mismatch, "
            "auth_host_missing, auth_host_mismatch, auth_stale, auth_replay, "
            "auth_unknown_agent (the key is not an agent of the community's roster) or "
            "auth_revoked (the key was revoked from it)."
        )
    )
    detail: str
    field: str | None = None
