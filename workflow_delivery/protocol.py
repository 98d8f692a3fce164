"""The delivery vocabulary: binding, causes, lease, record, results, message targets, wake hint.

Pure values, no I/O. Constructors and parsers validate their input and raise ``ProtocolError``
naming the offending field; no other exception escapes for bad input of any type.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeAlias
from uuid import UUID

from .exceptions import ProtocolError

__all__ = [
    "ERROR_MESSAGE_MAX_LENGTH",
    "ERROR_TRACEBACK_MAX_LENGTH",
    "ERROR_TYPE_MAX_LENGTH",
    "MESSAGE_KIND",
    "MESSAGE_V1_MARKER",
    "STEP_ID_MAX_LENGTH",
    "WAKE_HINT_KIND",
    "AgentStanding",
    "AlreadyTerminal",
    "Cause",
    "CauseKind",
    "Claimed",
    "ContentKind",
    "DeliveryBinding",
    "DeliveryRecord",
    "DeliveryStatus",
    "ErrorReport",
    "EventCause",
    "Exhausted",
    "FinishedAndNext",
    "Lease",
    "LeaseLost",
    "MessageEvent",
    "NewDelivery",
    "Outcome",
    "ProtocolError",
    "Reaped",
    "RecordedError",
    "Renewed",
    "Replied",
    "RequestAdmission",
    "RequestEvent",
    "Retried",
    "Revocation",
    "RosterEntry",
    "ScheduleCause",
    "SentMessage",
    "Settled",
    "Tags",
    "WakeHint",
    "WebhookCause",
    "as_bytes32",
    "as_datetime",
    "as_step_id",
    "as_uuid",
    "error_report",
    "message_v1_targets",
    "new_delivery_id",
]

MESSAGE_KIND = 9
WAKE_HINT_KIND = 24620
MESSAGE_V1_MARKER = "message-v1"
STEP_ID_MAX_LENGTH = 64
# The bounds of a recorded error, in characters (the tables' CHECKs hold them too).
ERROR_TYPE_MAX_LENGTH = 200
ERROR_MESSAGE_MAX_LENGTH = 2000
ERROR_TRACEBACK_MAX_LENGTH = 16000

Tags: TypeAlias = list[list[str]]

_HEX32 = re.compile(r"[0-9a-f]{64}")
_BIGINT_MAX = 2**63 - 1


def _uuid(field: str, value: object) -> UUID:
    """A ``UUID``, or its canonical lowercase hyphenated string, as a ``UUID``."""
    if type(value) is UUID:
        # Immutable: the caller's value is the value.
        return value
    if isinstance(value, UUID):
        return UUID(int=value.int)
    if isinstance(value, str) and len(value) == 36:
        try:
            parsed = UUID(value)
        except ValueError:
            pass
        else:
            if str(parsed) == value:
                return parsed
    raise ProtocolError(field, "must be a UUID or its canonical lowercase string")


def _bytes32(field: str, value: object) -> bytes:
    """Exactly 32 bytes from a bytes-like value."""
    if type(value) is bytes and len(value) == 32:
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ProtocolError(field, "must be bytes")
    try:
        data = bytes(value)
    except ValueError as exc:
        raise ProtocolError(field, "must be readable bytes") from exc
    if len(data) != 32:
        raise ProtocolError(field, f"must be exactly 32 bytes, not {len(data)}")
    return data


def _hex32(field: str, value: object) -> bytes:
    """Exactly 32 bytes from 64 lowercase hex characters."""
    if not isinstance(value, str) or len(value) != 64 or not _HEX32.fullmatch(value):
        raise ProtocolError(field, "must be 64 lowercase hex characters")
    return bytes.fromhex(value)


def _kind(expected: int, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value != expected:
        raise ProtocolError("kind", f"must be {expected}")


def _tags(value: object) -> Tags:
    if not isinstance(value, list) or not all(
        isinstance(tag, list) and all(isinstance(item, str) for item in tag) for tag in value
    ):
        raise ProtocolError("tags", "must be a list of lists of strings")
    return value


def _step_id(value: object) -> str:
    if not isinstance(value, str):
        raise ProtocolError("step_id", "must be a string")
    if not 1 <= len(value) <= STEP_ID_MAX_LENGTH:
        raise ProtocolError("step_id", f"must be 1 to {STEP_ID_MAX_LENGTH} characters")
    if value.isspace():
        raise ProtocolError("step_id", "must not be blank")
    if "\x00" in value:
        raise ProtocolError("step_id", "must not contain NUL")
    if value.isascii():
        return value
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ProtocolError("step_id", "must be encodable as UTF-8") from exc
    return value


def _utc_whole_seconds(field: str, value: object) -> datetime:
    """A timezone-aware datetime with no fraction of a second, in UTC."""
    if not isinstance(value, datetime):
        raise ProtocolError(field, "must be a datetime")
    try:
        instant = value.astimezone(UTC) if value.utcoffset() is not None else None
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(field, "must be a representable instant") from exc
    if instant is None:
        raise ProtocolError(field, "must be timezone-aware")
    if instant.microsecond:
        raise ProtocolError(field, "must be whole seconds")
    return instant


class CauseKind(StrEnum):
    EVENT = "event"
    SCHEDULE = "schedule"
    WEBHOOK = "webhook"


@dataclass(frozen=True, slots=True)
class EventCause:
    """The delivery was caused by an event (its 32-byte id)."""

    event_id: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "event_id", _bytes32("event_id", self.event_id))

    @property
    def kind(self) -> CauseKind:
        return CauseKind.EVENT


@dataclass(frozen=True, slots=True)
class ScheduleCause:
    """The delivery was caused by a schedule firing for a whole-second instant (held in UTC)."""

    scheduled_for: datetime

    def __post_init__(self) -> None:
        instant = _utc_whole_seconds("scheduled_for", self.scheduled_for)
        object.__setattr__(self, "scheduled_for", instant)

    @property
    def kind(self) -> CauseKind:
        return CauseKind.SCHEDULE


@dataclass(frozen=True, slots=True)
class WebhookCause:
    """The delivery was caused by a webhook invocation: an opaque id, never its payload."""

    invocation_id: UUID

    def __post_init__(self) -> None:
        object.__setattr__(self, "invocation_id", _uuid("invocation_id", self.invocation_id))

    @property
    def kind(self) -> CauseKind:
        return CauseKind.WEBHOOK


Cause: TypeAlias = EventCause | ScheduleCause | WebhookCause


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (DeliveryStatus.FINISHED, DeliveryStatus.FAILED)


class Outcome(StrEnum):
    FINISHED = "finished"
    FAILED = "failed"


class ContentKind(StrEnum):
    """What a message's content is: text (a ``str``), or a JSON value."""

    TEXT = "text"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class DeliveryBinding:
    """What one delivery is bound to: tenant, workflow run step, target, definition, message, cause.

    Equality covers every field, the cause included; a claim with an expected binding must match
    all of it.
    """

    community_id: UUID
    workflow_id: UUID
    run_id: UUID
    step_id: str
    target_pubkey: bytes
    definition_event_id: bytes
    message_event_id: bytes
    cause: Cause

    def __post_init__(self) -> None:
        community_id = _uuid("community_id", self.community_id)
        if community_id.int == 0:
            raise ProtocolError("community_id", "must not be the nil UUID")
        object.__setattr__(self, "community_id", community_id)
        object.__setattr__(self, "workflow_id", _uuid("workflow_id", self.workflow_id))
        object.__setattr__(self, "run_id", _uuid("run_id", self.run_id))
        object.__setattr__(self, "step_id", _step_id(self.step_id))
        object.__setattr__(self, "target_pubkey", _bytes32("target_pubkey", self.target_pubkey))
        object.__setattr__(
            self, "definition_event_id", _bytes32("definition_event_id", self.definition_event_id)
        )
        object.__setattr__(
            self, "message_event_id", _bytes32("message_event_id", self.message_event_id)
        )
        if not isinstance(self.cause, EventCause | ScheduleCause | WebhookCause):
            raise ProtocolError("cause", "must be an EventCause, ScheduleCause or WebhookCause")

    def validate_message_event(self, kind: int, event_id: bytes, tags: Tags) -> None:
        """Check that an event is this binding's kind-9 message and names its target."""
        _kind(MESSAGE_KIND, kind)
        if _bytes32("event_id", event_id) != self.message_event_id:
            raise ProtocolError("event_id", "is not the binding's message event")
        if self.target_pubkey not in message_v1_targets(kind, tags):
            raise ProtocolError("target_pubkey", "is not a message-v1 target of the message")


@dataclass(frozen=True, slots=True, init=False)
class NewDelivery:
    """A delivery the producer is about to commit.

    ``NewDelivery(binding)`` or ``NewDelivery(binding=binding)`` gives it a fresh,
    time-ordered id (``new_delivery_id()``); ``NewDelivery(id, binding)`` keeps the id
    the producer chose, any UUID (a random one too)."""

    id: UUID
    binding: DeliveryBinding

    def __init__(
        self, id: UUID | str | None = None, binding: DeliveryBinding | None = None
    ) -> None:
        if binding is None and isinstance(id, DeliveryBinding):
            id, binding = None, id
        if not isinstance(binding, DeliveryBinding):
            raise ProtocolError("binding", "must be a DeliveryBinding")
        object.__setattr__(self, "id", new_delivery_id() if id is None else _uuid("id", id))
        object.__setattr__(self, "binding", binding)


@dataclass(frozen=True, slots=True)
class Lease:
    """The capability to act on a claimed delivery; ``generation`` is its fencing token."""

    community_id: UUID
    delivery_id: UUID
    target_pubkey: bytes
    generation: int
    lease_until: datetime

    def __post_init__(self) -> None:
        # Checked like every other input, so a forged or mangled lease is a clear
        # error here instead of a raw DataError from the database.
        object.__setattr__(self, "community_id", _uuid("community_id", self.community_id))
        object.__setattr__(self, "delivery_id", _uuid("delivery_id", self.delivery_id))
        object.__setattr__(self, "target_pubkey", _bytes32("target_pubkey", self.target_pubkey))
        generation = self.generation
        if not (isinstance(generation, int) and not isinstance(generation, bool)):
            raise ProtocolError("generation", f"must be a whole number, not {generation!r}")
        if not 0 <= generation <= _BIGINT_MAX:
            raise ProtocolError("generation", f"must be between 0 and {_BIGINT_MAX}")
        object.__setattr__(self, "lease_until", as_datetime("lease_until", self.lease_until))


@dataclass(frozen=True, slots=True)
class RecordedError:
    """The last error a holder reported for a delivery (a retry or a failure):
    the exception's type, its message, and when, by the database clock. Its
    traceback is in the delivery's timeline entry of that moment."""

    type: str
    message: str
    at: datetime


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """A delivery as stored.

    ``attempts`` counts its claims. ``available_at`` is set only on a pending
    delivery a holder gave back to be retried: no claim takes it before then.
    ``last_error`` is the last error reported for it (kept once it settles)."""

    id: UUID
    binding: DeliveryBinding
    status: DeliveryStatus
    lease_generation: int
    lease_until: datetime | None
    claimed_at: datetime | None
    finished_at: datetime | None
    created_at: datetime
    message_event_created_at: datetime
    attempts: int = 0
    available_at: datetime | None = None
    last_error: RecordedError | None = None


@dataclass(frozen=True, slots=True)
class MessageEvent:
    """The visible message a delivery carries to its target, as stored. ``content`` is
    a ``str`` when ``content_kind`` is text, the decoded JSON value when it is JSON."""

    id: bytes
    pubkey: bytes
    created_at: datetime
    kind: int
    tags: Tags
    content: Any
    content_kind: ContentKind = ContentKind.TEXT


@dataclass(frozen=True, slots=True)
class SentMessage:
    """What ``send_message`` committed, or found committed under the same idempotency
    key (``created`` False): the run and step, the message, one record per target."""

    run_id: UUID
    step_id: str
    message: MessageEvent
    deliveries: tuple[DeliveryRecord, ...]
    created: bool


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claim as the agent API answers it: the lease, the record and the message.
    Unpacks and indexes as ``(lease, record)``, the pair ``claim_delivery`` returns."""

    lease: Lease
    record: DeliveryRecord
    message: MessageEvent | None

    def __iter__(self):
        return iter((self.lease, self.record))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Lease | DeliveryRecord:
        return (self.lease, self.record)[index]


class AgentStanding(StrEnum):
    """Where a key stands in a community's agent roster (absent: not enrolled)."""

    ENABLED = "enabled"
    REVOKED = "revoked"


@dataclass(frozen=True, slots=True)
class RosterEntry:
    """One agent of a community's roster."""

    community_id: UUID
    pubkey: bytes
    label: str
    enabled: bool
    added_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class Revocation:
    """A revoked agent and the deliveries whose leases the revocation released (back
    to pending, generation bumped)."""

    entry: RosterEntry
    released: tuple[UUID, ...]


@dataclass(frozen=True, slots=True)
class RequestAdmission:
    """A signed request checked against the database: the community its host names
    (None when none), whether its ``created_at`` is fresh, whether its event id was
    recorded now (False when it was already used, in any community, and for a key
    that is not an enabled agent), and where the signing key stands in the
    community's roster (None: not enrolled, or no community). ``deleting``: the
    community's deletion executor holds its deletion lock, so nothing was looked up
    or recorded."""

    community_id: UUID | None
    fresh: bool
    recorded: bool
    standing: AgentStanding | None = None
    deleting: bool = False


@dataclass(frozen=True, slots=True)
class Renewed:
    lease_until: datetime


@dataclass(frozen=True, slots=True)
class Settled:
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class AlreadyTerminal:
    """The caller's own delivery had already settled; ``status`` is what was recorded."""

    status: DeliveryStatus


@dataclass(frozen=True, slots=True)
class Reaped:
    """What a reaper sweep did: leases returned to pending, and leases of deliveries
    that had used every attempt, settled failed instead."""

    reclaimed: int = 0
    exhausted: int = 0

    @property
    def total(self) -> int:
        return self.reclaimed + self.exhausted


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """The lease no longer lets its holder act: expired, reaped, superseded or not its target."""


@dataclass(frozen=True, slots=True)
class Retried:
    """The delivery went back to pending with its error kept; no claim takes it
    before ``available_at`` (database clock). ``attempts`` is the claims used so far."""

    available_at: datetime
    attempts: int


@dataclass(frozen=True, slots=True)
class Exhausted:
    """The delivery had used every attempt (``WORKFLOW_DELIVERY_MAX_ATTEMPTS``): it
    settled ``failed`` with its error kept, as the reaper settles such a lease."""

    attempts: int


@dataclass(frozen=True, slots=True)
class Replied:
    """A reply sent to a held delivery, as the agent API answers it: the reply's
    message id, its run and step, the deliveries of it, and whether this call sent
    it (``created`` False: the same key's reply was already sent)."""

    message_id: bytes
    run_id: UUID
    step_id: str
    created: bool
    deliveries: tuple[UUID, ...]


@dataclass(frozen=True, slots=True)
class FinishedAndNext:
    """A settle and the claim that came with it: ``result`` is what ``finish_delivery``
    would have answered; ``next`` the next delivery claimed in the same statement
    (a ``(lease, record)`` pair, or a ``Claimed`` with its message over the agent
    API), None when nothing was claimed. Only a ``Settled`` result claims."""

    result: Settled | AlreadyTerminal | LeaseLost
    next: tuple[Lease, DeliveryRecord] | Claimed | None = None


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A signed request as the services admit it: the host it names, its event's id
    and ``created_at`` (whole seconds), and the key that signed it. The signature is
    checked before (``api.nip98``); the services check the rest (community, roster,
    freshness, replay) in the statement that serves the request."""

    host: str
    event_id: bytes
    created_at: int
    pubkey: bytes


@dataclass(frozen=True, slots=True)
class ErrorReport:
    """An error as it is recorded: type, message and traceback (or None), each
    within its bound, as text PostgreSQL stores (no NUL, valid UTF-8)."""

    type: str
    message: str
    traceback: str | None


def _storable(text: str, bound: int) -> str:
    """``text`` as PostgreSQL's ``text`` takes it, cut to ``bound`` characters (the
    cut marked with an ellipsis)."""
    text = text.replace("\x00", "\\x00")
    if not text.isascii():
        # A lone surrogate (from undecodable bytes) cannot be sent as UTF-8.
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > bound:
        text = text[: bound - 1] + "…"
    return text


def _type_name(error: BaseException) -> str:
    kind = type(error)
    module = kind.__module__
    name = kind.__qualname__
    return name if module in ("builtins", "__main__") else f"{module}.{name}"


def error_report(error: object) -> ErrorReport:
    """What is recorded of ``error``: an exception (its qualified type, its message,
    its traceback with its causes, as ``traceback`` formats it), or a non-blank
    string given as the reason (type ``error``, no traceback). Anything longer than
    its bound is cut; anything else is a ``ProtocolError`` naming ``error``."""
    if isinstance(error, BaseException):
        try:
            message = str(error)
        except Exception:  # noqa: BLE001 - an exception whose __str__ itself fails
            message = f"<{type(error).__name__} whose message cannot be read>"
        formatted = None
        if error.__traceback__ is not None or error.__cause__ or error.__context__:
            formatted = "".join(traceback.format_exception(error))
        return ErrorReport(
            type=_storable(_type_name(error), ERROR_TYPE_MAX_LENGTH),
            message=_storable(message, ERROR_MESSAGE_MAX_LENGTH),
            traceback=None
            if formatted is None
            else _storable(formatted, ERROR_TRACEBACK_MAX_LENGTH),
        )
    if not isinstance(error, str):
        raise ProtocolError(
            "error", f"must be an exception or a string, not {type(error).__name__}"
        )
    if not error.strip():
        raise ProtocolError("error", "must not be blank")
    return ErrorReport(
        type="error", message=_storable(error, ERROR_MESSAGE_MAX_LENGTH), traceback=None
    )


def new_delivery_id() -> UUID:
    """A fresh delivery id that sorts by the time it was made: a UUID of version 7
    (RFC 9562: 48 bits of Unix time in milliseconds, then 74 random bits).

    A producer may choose any UUID, but every status change of a delivery inserts a
    new entry for its id into the table's keys on ``id`` (the primary key, the
    ``(community_id, id)`` key, the timeline's ``(community_id, delivery_id, id)``).
    With random ids the live deliveries' entries are spread over every page of those
    keys, however many settled deliveries sit beside them; with ids that grow with
    time they share the few newest pages."""
    milliseconds = time.time_ns() // 1_000_000
    random = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (milliseconds & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76  # version 7
    value |= (random >> 68) << 64  # rand_a: 12 bits
    value |= 0b10 << 62  # the RFC 9562 variant
    value |= random & 0x3FFF_FFFF_FFFF_FFFF  # rand_b: 62 bits
    return UUID(int=value)


def message_v1_targets(kind: int, tags: Tags) -> list[bytes]:
    """The targets of a visible workflow message (kind 9), in tag order.

    A tag carrying the ``message-v1`` marker after its key must be exactly
    ``["p", <64 lowercase hex>, "", "message-v1"]`` and name a target not named before. Tags
    without the marker, plain ``p`` mentions included, are not targets.
    """
    _kind(MESSAGE_KIND, kind)
    targets: list[bytes] = []
    seen: set[bytes] = set()
    for index, tag in enumerate(_tags(tags)):
        if MESSAGE_V1_MARKER not in tag[1:]:
            continue
        if len(tag) != 4:
            raise ProtocolError("tags", f"target tag {index} must have exactly 4 elements")
        if tag[0] != "p":
            raise ProtocolError("tags", f"target tag {index} must have the key 'p'")
        if tag[3] != MESSAGE_V1_MARKER:
            raise ProtocolError("tags", f"target tag {index} must end with the marker")
        if tag[2] != "":
            raise ProtocolError("tags", f"target tag {index} must have an empty relay slot")
        target = _hex32("tags", tag[1])
        if target in seen:
            raise ProtocolError("tags", f"target tag {index} repeats a target")
        seen.add(target)
        targets.append(target)
    return targets


@dataclass(frozen=True, slots=True)
class WakeHint:
    """A kind-24620 nudge: a delivery for this target may be waiting.

    An accelerator, never an authority: anyone can publish one, so a claim it prompts still goes
    through the full binding check in the service layer.
    """

    target_pubkey: bytes
    delivery_id: UUID

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_pubkey", _bytes32("target_pubkey", self.target_pubkey))
        object.__setattr__(self, "delivery_id", _uuid("delivery_id", self.delivery_id))

    @classmethod
    def parse(cls, kind: int, content: str, tags: Tags) -> WakeHint:
        """Read a wake-hint event: empty content, one ``p`` tag and one ``delivery`` tag."""
        _kind(WAKE_HINT_KIND, kind)
        if not isinstance(content, str) or content:
            raise ProtocolError("content", "must be empty")
        values: dict[str, str] = {}
        for tag in _tags(tags):
            if len(tag) != 2:
                raise ProtocolError("tags", "each tag must have exactly 2 elements")
            key, value = tag
            if key not in ("p", "delivery"):
                raise ProtocolError("tags", "only 'p' and 'delivery' tags are allowed")
            if key in values:
                raise ProtocolError("tags", f"repeated {key!r} tag")
            values[key] = value
        for key in ("p", "delivery"):
            if key not in values:
                raise ProtocolError("tags", f"missing {key!r} tag")
        return cls(_hex32("target_pubkey", values["p"]), _uuid("delivery_id", values["delivery"]))

    def tags(self) -> Tags:
        return [["p", self.target_pubkey.hex()], ["delivery", str(self.delivery_id)]]


def _trusted(cls: type, **fields: object) -> object:
    """An instance of the frozen dataclass ``cls`` with ``fields`` taken as they are."""
    instance = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(instance, name, value)
    return instance


_STATUSES = {status.value: status for status in DeliveryStatus}


def stored_cause(
    kind: str, event_id: bytes | None, scheduled_for: datetime | None, invocation_id: UUID | None
) -> Cause:
    """The cause of a row read back from the delivery table, not re-validated: the
    table's CHECK constraints hold exactly one identity of the right shape. Never for
    data coming in."""
    if kind == CauseKind.EVENT:
        return _trusted(EventCause, event_id=bytes(event_id))
    if kind == CauseKind.SCHEDULE:
        # The database hands the instant back in the connection's time zone; a
        # constructed cause holds it in UTC.
        return _trusted(ScheduleCause, scheduled_for=scheduled_for.astimezone(UTC))
    return _trusted(WebhookCause, invocation_id=invocation_id)


def stored_binding(
    community_id: UUID,
    workflow_id: UUID,
    run_id: UUID,
    step_id: str,
    target_pubkey: bytes,
    definition_event_id: bytes,
    message_event_id: bytes,
    cause: Cause,
) -> DeliveryBinding:
    """The binding of a row read back from the delivery table, not re-validated: the
    table's types, CHECK constraints and foreign keys already hold every rule that
    ``DeliveryBinding`` checks. Never for data coming in."""
    return _trusted(
        DeliveryBinding,
        community_id=community_id,
        workflow_id=workflow_id,
        run_id=run_id,
        step_id=step_id,
        target_pubkey=bytes(target_pubkey),
        definition_event_id=bytes(definition_event_id),
        message_event_id=bytes(message_event_id),
        cause=cause,
    )


def stored_lease(community_id: UUID, target_pubkey: bytes, record: DeliveryRecord) -> Lease:
    """The lease a claim just took, not re-validated: the claimant's community and
    target (checked on the way in) and the row's id, generation and lease end as the
    database returned them. Never for a lease coming in."""
    return _trusted(
        Lease,
        community_id=community_id,
        delivery_id=record.id,
        target_pubkey=target_pubkey,
        generation=record.lease_generation,
        lease_until=record.lease_until,
    )


def stored_message(
    event_id: bytes,
    created_at: datetime,
    pubkey: bytes,
    kind: int,
    tags: str,
    content: str,
    is_json: bool = False,
) -> MessageEvent:
    """A message event as a statement read it: the columns of ``store.statements.MESSAGE_EVENTS``
    (``tags`` as JSON text; ``is_json`` whether the row holds a JSON value, whose
    encoding ``content`` is), not re-validated."""
    return MessageEvent(
        id=bytes(event_id),
        pubkey=bytes(pubkey),
        created_at=created_at,
        kind=kind,
        tags=json.loads(tags),
        content=json.loads(content) if is_json else content,
        content_kind=ContentKind.JSON if is_json else ContentKind.TEXT,
    )


def stored_status(value: str) -> DeliveryStatus:
    """A status read back from the table (its CHECK allows only the four)."""
    return _STATUSES[value]


def as_uuid(field: str, value: object) -> UUID:
    """Validate an id for the service layer: a ``UUID`` or its canonical string."""
    return _uuid(field, value)


def as_bytes32(field: str, value: object) -> bytes:
    """Validate a 32-byte value (a public key or event id) for the service layer."""
    return _bytes32(field, value)


def as_step_id(value: object) -> str:
    """Validate a step id: 1 to 64 characters, not blank, no NUL."""
    return _step_id(value)


def as_datetime(field: str, value: object) -> datetime:
    """Validate a timezone-aware instant (fractions of a second are kept)."""
    try:
        aware = isinstance(value, datetime) and value.utcoffset() is not None
    except (TypeError, ValueError):
        aware = False
    if not aware:
        raise ProtocolError(field, "must be a timezone-aware datetime")
    return value


@dataclass(frozen=True, slots=True)
class CommunityCreated:
    """What ``services.create_community`` did: ``created`` is False when a
    community already had the host (any case), whose id and state it reports."""

    id: UUID
    host: str
    deletion_state: str
    created: bool
