"""The producer's one call: ``send_message`` stores a message and commits one delivery
of it per target, atomically and idempotently under a key the caller chooses.

What a delivery refers to is made on first use, in the same transaction:

* the **run**: ``uuid5(community, key)``, unless the caller names an existing run;
  an id another community's row holds is passed over for the next one derived
  (``run_id_for(community, key, 1)``, …), the first the community holds winning, so
  a retry finds the run its first call made;
* the **step**: the idempotency key itself (so a key is 1 to 64 characters);
* the **workflow**: one per community, ``send_message``, with a deterministic id
  (derived in turn the same way), inserted once (``ON CONFLICT DO NOTHING``), unless
  the caller names one;
* the **message event** (kind 9 by default): its tags name each target
  (``["p", <hex>, "", "message-v1"]``), then ``["run", <run id>, <step>]`` so the
  message is found from its run, then the caller's tags. Its id is the NIP-01 id of
  its fields. The table keeps no signature: a message is vouched for by the database
  that stored it, and its ``pubkey`` names the ``sender`` the caller gives, or the
  32 zero bytes (``UNSIGNED_SENDER``), a key nobody holds, when it gives none.
  An existing event may be sent instead (``message_event_id``).

The step's identity lock serialises two calls with one key; the second finds the
first's deliveries and returns them (``created`` False), if it asks for the same
message, or raises ``IdempotencyConflict``. The key is remembered as long as its
deliveries are (``prune_deliveries`` removes settled ones after their retention).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib.postgres.functions import TransactionNow
from django.db import DEFAULT_DB_ALIAS
from django.db.models import BooleanField, ExpressionWrapper, JSONField, Q, TextField, Value
from django.db.models.functions import Cast

from ..conf import app_settings
from ..content import encode_content
from ..exceptions import (
    CommunityNotFound,
    IdempotencyConflict,
    MessageTooLarge,
    ProtocolError,
)
from ..keys import event_id as nip01_event_id
from ..models import Community, Event, Workflow, WorkflowAgentDelivery, WorkflowRun
from ..protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    STEP_ID_MAX_LENGTH,
    Cause,
    ContentKind,
    DeliveryBinding,
    DeliveryRecord,
    EventCause,
    MessageEvent,
    NewDelivery,
    ScheduleCause,
    SentMessage,
    Tags,
    WebhookCause,
    as_bytes32,
    as_uuid,
    message_v1_targets,
)
from ..store.errors import database_errors
from ..store.rows import RECORD_COLUMNS, record
from ..validation import checked_text
from .holder import MAX_BATCH_SIZE
from .producer import delivery_identity

__all__ = ["MAX_TARGETS", "NAMESPACE", "UNSIGNED_SENDER", "WORKFLOW_NAME", "send_message"]

# The names of the rows send_message makes: uuid5 in this namespace.
NAMESPACE = UUID("6f1c7e0a-3c2b-5d8e-9a41-2b7d0c9e5f13")
WORKFLOW_NAME = "send_message"
UNSIGNED_SENDER = bytes(32)
# One statement inserts every delivery of a message.
MAX_TARGETS = MAX_BATCH_SIZE
MAX_KIND = 65535
# Whether an event row holds a JSON value (read instead of the value itself, which
# its ``content`` encodes).
_IS_JSON = ExpressionWrapper(Q(content_json__isnull=False), output_field=BooleanField())
_MESSAGE_COLUMNS = ("id", "created_at", "pubkey", "kind", "tags", "content", "is_json")


# Ids are global keys: the ids derived for a community, the first one onwards, are
# tried in turn while another community's row holds them.
DERIVED_IDS = 16


def workflow_id_for(community_id: UUID, attempt: int = 0) -> UUID:
    """The id of the community's ``send_message`` workflow (its ``attempt``-th candidate)."""
    suffix = f"\x00{attempt}" if attempt else ""
    return uuid.uuid5(NAMESPACE, f"workflow/{community_id}{suffix}")


def run_id_for(community_id: UUID, idempotency_key: str, attempt: int = 0) -> UUID:
    """The id of the run ``send_message`` makes for one idempotency key (its
    ``attempt``-th candidate; a key holds no NUL, so no two names meet)."""
    suffix = f"\x00{attempt}" if attempt else ""
    return uuid.uuid5(NAMESPACE, f"run/{community_id}/{idempotency_key}{suffix}")


def _derived_id(
    model: type[Workflow | WorkflowRun], community_id: UUID, candidates: list[UUID], using: str
) -> UUID | None:
    """The first candidate the community holds, else the first nobody holds, else None."""
    holders = dict(
        model.objects.using(using).filter(id__in=candidates).values_list("id", "community_id")
    )
    for candidate in candidates:
        if holders.get(candidate) == community_id:
            return candidate
    return next((candidate for candidate in candidates if candidate not in holders), None)


def _derived_run_id(community_id: UUID, key: str, using: str) -> UUID:
    candidates = [run_id_for(community_id, key, attempt) for attempt in range(DERIVED_IDS)]
    found = _derived_id(WorkflowRun, community_id, candidates, using)
    if found is None:
        raise IdempotencyConflict(
            "idempotency_key",
            f"every run id derived from {key!r} is another community's run; "
            "send under another key, or name a run_id",
        )
    return found


def _key(value: object) -> str:
    key = checked_text("idempotency_key", value)
    if not 1 <= len(key) <= STEP_ID_MAX_LENGTH:
        raise ProtocolError(
            "idempotency_key", f"must be 1 to {STEP_ID_MAX_LENGTH} characters (it is the step id)"
        )
    if key.isspace():
        raise ProtocolError("idempotency_key", "must not be blank")
    return key


def _public_key(field: str, value: object) -> bytes:
    if isinstance(value, str):
        text = value.lower()
        if len(text) != 64 or any(char not in "0123456789abcdef" for char in text):
            raise ProtocolError(field, f"must be 32 bytes or 64 hex characters, not {value!r}")
        return bytes.fromhex(text)
    return as_bytes32(field, value)


def _targets(value: object) -> list[bytes]:
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Iterable):
        raise ProtocolError("targets", "must be a list of public keys (32 bytes or 64 hex)")
    targets: list[bytes] = []
    for item in value:
        target = _public_key("targets", item)
        if target in targets:
            raise ProtocolError("targets", f"target {target.hex()} appears twice")
        targets.append(target)
        if len(targets) > MAX_TARGETS:
            raise ProtocolError("targets", f"at most {MAX_TARGETS} targets per message")
    if not targets:
        raise ProtocolError("targets", "name at least one target")
    return targets


def _kind(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_KIND:
        raise ProtocolError("kind", f"must be a whole number from 0 to {MAX_KIND}, not {value!r}")
    return value


def _tags(value: object) -> Tags:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise ProtocolError("tags", "must be a list of lists of strings")
    tags: Tags = []
    for index, tag in enumerate(value):
        if not isinstance(tag, list | tuple) or not tag:
            raise ProtocolError("tags", f"tag {index} must be a non-empty list of strings")
        tags.append([checked_text("tags", item) for item in tag])
        if MESSAGE_V1_MARKER in tags[-1]:
            raise ProtocolError(
                "tags",
                f"tag {index} carries {MESSAGE_V1_MARKER!r}: the targets name the addressees",
            )
    return tags


def _encoded_size(value: object) -> int:
    """Bytes of ``value`` as stored: UTF-8 text, or a JSON value's compact encoding."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def _bounded(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` when its content and tags are within the settings' bounds; else
    ``MessageTooLarge`` naming the bound."""
    content, tags = request["content"], request["tags"]
    if content is not None:
        limit = app_settings.MAX_MESSAGE_CONTENT_BYTES
        size = _encoded_size(content)
        if size > limit:
            setting = "WORKFLOW_DELIVERY_MAX_MESSAGE_CONTENT_BYTES"
            raise MessageTooLarge("content", setting, limit, size, "bytes")
    limit = app_settings.MAX_MESSAGE_TAGS
    if len(tags) > limit:
        raise MessageTooLarge(
            "tags", "WORKFLOW_DELIVERY_MAX_MESSAGE_TAGS", limit, len(tags), "tags"
        )
    limit = app_settings.MAX_MESSAGE_TAGS_BYTES
    size = _encoded_size(tags)
    if size > limit:
        raise MessageTooLarge(
            "tags", "WORKFLOW_DELIVERY_MAX_MESSAGE_TAGS_BYTES", limit, size, "bytes"
        )
    return request


def _few_enough(tags: object) -> object:
    """``tags`` unchanged, unless a list of them is over the count before each is read."""
    limit = app_settings.MAX_MESSAGE_TAGS
    if isinstance(tags, list | tuple) and len(tags) > limit:
        raise MessageTooLarge(
            "tags", "WORKFLOW_DELIVERY_MAX_MESSAGE_TAGS", limit, len(tags), "tags"
        )
    return tags


def _optional_bytes32(field: str, value: object) -> bytes | None:
    return None if value is None else as_bytes32(field, value)


def _cause(value: object) -> Cause | None:
    if value is not None and not isinstance(value, EventCause | ScheduleCause | WebhookCause):
        raise ProtocolError("cause", "must be an EventCause, ScheduleCause or WebhookCause")
    return value


def _message_tags(targets: list[bytes], run_id: UUID, step_id: str, tags: Tags) -> Tags:
    addressed = [["p", target.hex(), "", MESSAGE_V1_MARKER] for target in targets]
    return [*addressed, ["run", str(run_id), step_id], *tags]


def _own_tags(message: MessageEvent, run_id: UUID, step_id: str) -> Tags:
    """The caller's tags of a message ``send_message`` made: what follows its derived
    run tag, the caller's own ``run`` tags included."""
    derived = ["run", str(run_id), step_id]
    tags = [tag for tag in message.tags if MESSAGE_V1_MARKER not in tag[1:]]
    return tags[tags.index(derived) + 1 :] if derived in tags else tags


def _records(community_id: UUID, run_id: UUID, step_id: str, using: str) -> list[DeliveryRecord]:
    rows = (
        WorkflowAgentDelivery.objects.using(using)
        .filter(community_id=community_id, run_id=run_id, step_id=step_id)
        .values_list(*RECORD_COLUMNS)
    )
    return [record(row) for row in rows]


def _in_target_order(records: list[DeliveryRecord], targets: list[bytes]) -> tuple:
    order = {target: index for index, target in enumerate(targets)}
    return tuple(sorted(records, key=lambda r: order.get(r.binding.target_pubkey, len(order))))


def _message_of(community_id: UUID, record: DeliveryRecord, using: str) -> MessageEvent:
    row = (
        Event.objects.using(using)
        .filter(
            community_id=community_id,
            created_at=record.message_event_created_at,
            id=record.binding.message_event_id,
        )
        .annotate(is_json=_IS_JSON)
        .values_list(*_MESSAGE_COLUMNS)
        .get()
    )
    return _message(row)


def _message(row: Any) -> MessageEvent:
    event_id, created_at, pubkey, kind, tags, content, is_json = row
    return MessageEvent(
        id=bytes(event_id),
        pubkey=bytes(pubkey),
        created_at=created_at,
        kind=kind,
        tags=tags,
        content=json.loads(content) if is_json else content,
        content_kind=ContentKind.JSON if is_json else ContentKind.TEXT,
    )


def _as_jsonb(text: str) -> Cast:
    """The JSON value ``text`` encodes, as PostgreSQL parses it."""
    return Cast(Value(text, TextField()), JSONField())


def _same_json(community_id: UUID, message: MessageEvent, text: str, using: str) -> bool:
    """Whether the stored message's JSON value equals the one ``text`` encodes, as
    ``jsonb`` compares them (key order and number spelling aside)."""
    return (
        Event.objects.using(using)
        .filter(
            community_id=community_id,
            created_at=message.created_at,
            id=message.id,
            content_json=_as_jsonb(text),
        )
        .exists()
    )


def _differences(
    community_id: UUID,
    request: dict[str, Any],
    message: MessageEvent,
    targets: set[bytes],
    using: str,
    run_id: UUID,
    step_id: str,
) -> list[str]:
    found = []
    if targets != set(request["targets"]):
        found.append("targets")
    if request["message_event_id"] is not None:
        if message.id != request["message_event_id"]:
            found.append("message_event_id")
        return found
    if message.content_kind is not request["content_kind"]:
        found.append("content")
    elif message.content_kind is ContentKind.TEXT:
        if message.content != request["content"]:
            found.append("content")
    elif not _same_json(community_id, message, request["content"], using):
        found.append("content")
    if message.kind != request["kind"]:
        found.append("kind")
    if message.pubkey != request["sender"]:
        found.append("sender")
    if _own_tags(message, run_id, step_id) != request["tags"]:
        found.append("tags")
    return found


def _already_sent(
    community_id: UUID, run_id: UUID, key: str, request: dict[str, Any], using: str
) -> SentMessage:
    records = _records(community_id, run_id, key, using)
    message = _message_of(community_id, records[0], using)
    differences = _differences(
        community_id,
        request,
        message,
        {record.binding.target_pubkey for record in records},
        using,
        run_id,
        key,
    )
    if differences:
        raise IdempotencyConflict(
            "idempotency_key",
            f"{key!r} already sent a message with other {', '.join(differences)}; "
            "a retry must send the same message, a new message needs a new key",
        )
    return SentMessage(
        run_id=run_id,
        step_id=key,
        message=message,
        deliveries=_in_target_order(records, request["targets"]),
        created=False,
    )


def _database_now(community_id: UUID, using: str) -> datetime:
    now = (
        Community.objects.using(using)
        .filter(pk=community_id)
        .annotate(now=TransactionNow())
        .values_list("now", flat=True)
        .first()
    )
    if now is None:
        raise CommunityNotFound(f"community {community_id} does not exist")
    return now


def _workflow(community_id: UUID, workflow_id: UUID | None, using: str) -> UUID:
    if workflow_id is not None:
        if (
            not Workflow.objects.using(using)
            .filter(community_id=community_id, id=workflow_id)
            .exists()
        ):
            raise ProtocolError(
                "workflow_id", f"no workflow {workflow_id} in community {community_id}"
            )
        return workflow_id
    candidates = [workflow_id_for(community_id, attempt) for attempt in range(DERIVED_IDS)]
    default = _derived_id(Workflow, community_id, candidates, using)
    if default is None:
        raise ProtocolError(
            "workflow_id",
            f"every workflow id derived for community {community_id} is another "
            "community's workflow; name a workflow_id",
        )
    # Inserted by whichever first send gets there; a concurrent one waits on the key
    # and then does nothing.
    Workflow.objects.using(using).bulk_create(
        [
            Workflow(
                id=default,
                community_id=community_id,
                name=WORKFLOW_NAME,
                owner_pubkey=UNSIGNED_SENDER,
                definition={},
            )
        ],
        ignore_conflicts=True,
    )
    if not Workflow.objects.using(using).filter(community_id=community_id, id=default).exists():
        raise ProtocolError(
            "workflow_id",
            f"workflow id {default} was taken by another community meanwhile; send again",
        )
    return default


def _run(
    community_id: UUID, run_id: UUID, given: bool, workflow_id: UUID | None, using: str
) -> WorkflowRun:
    runs = WorkflowRun.objects.using(using).filter(community_id=community_id, id=run_id)
    if not given:
        workflow = _workflow(community_id, workflow_id, using)
        # A run left by a key whose deliveries were pruned is used again.
        WorkflowRun.objects.using(using).bulk_create(
            [WorkflowRun(id=run_id, community_id=community_id, workflow_id=workflow)],
            ignore_conflicts=True,
        )
    run = runs.only("id", "workflow_id", "definition_event_id").first()
    if run is None and not given:
        raise IdempotencyConflict(
            "idempotency_key",
            f"run id {run_id} was taken by another community meanwhile; send again",
        )
    if run is None:
        raise ProtocolError("run_id", f"no run {run_id} in community {community_id}")
    if workflow_id is not None and run.workflow_id != workflow_id:
        raise ProtocolError(
            "workflow_id", f"run {run_id} belongs to workflow {run.workflow_id}, not {workflow_id}"
        )
    return run


def _existing_message(
    community_id: UUID, event_id: bytes, targets: list[bytes], using: str
) -> MessageEvent:
    row = (
        Event.objects.using(using)
        .filter(community_id=community_id, id=event_id)
        .annotate(is_json=_IS_JSON)
        .values_list(*_MESSAGE_COLUMNS)
        .first()
    )
    if row is None:
        raise ProtocolError(
            "message_event_id", f"no event {event_id.hex()} in community {community_id}"
        )
    message = _message(row)
    addressed = set(message_v1_targets(message.kind, message.tags))
    for target in targets:
        if target not in addressed:
            raise ProtocolError(
                "targets", f"{target.hex()} is not a target of message {event_id.hex()}"
            )
    return message


def _new_message(
    community_id: UUID, run_id: UUID, key: str, request: dict[str, Any], now: datetime, using: str
) -> MessageEvent:
    created_at = now.replace(microsecond=0)
    tags = _message_tags(request["targets"], run_id, key, request["tags"])
    sender, kind, content = request["sender"], request["kind"], request["content"]
    is_json = request["content_kind"] is ContentKind.JSON
    event_id = nip01_event_id(sender, int(created_at.timestamp()), kind, tags, content)
    # The same fields give the same id: an identical event already stored is this one.
    Event.objects.using(using).bulk_create(
        [
            Event(
                id=event_id,
                community_id=community_id,
                created_at=created_at,
                kind=kind,
                pubkey=sender,
                content=content,
                # Parsed from the encoded text, so JSON null is jsonb null, not NULL.
                content_json=_as_jsonb(content) if is_json else None,
                tags=tags,
            )
        ],
        ignore_conflicts=True,
    )
    if is_json:
        return MessageEvent(
            event_id, sender, created_at, kind, tags, json.loads(content), ContentKind.JSON
        )
    return MessageEvent(event_id, sender, created_at, kind, tags, content)


def send_message(
    community_id: UUID | str,
    *,
    targets: Iterable[bytes | str],
    content: Any = None,
    idempotency_key: str,
    content_kind: ContentKind | str | None = None,
    kind: int = MESSAGE_KIND,
    tags: Tags | None = None,
    sender: bytes | str | None = None,
    run_id: UUID | str | None = None,
    workflow_id: UUID | str | None = None,
    message_event_id: bytes | None = None,
    definition_event_id: bytes | None = None,
    cause: Cause | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> SentMessage:
    """Send ``content`` to each of ``targets`` (32-byte public keys, or 64 hex) in
    ``community_id``: one message event and one pending delivery per target, all
    committed in one transaction, or nothing. ``content`` is text (a ``str``) or a
    JSON value (anything else but ``None``; ``content_kind="json"`` makes a ``str``
    or ``None`` one too); ``message.content`` is that value decoded from what was
    stored. Calling again with the same ``idempotency_key`` (a retry after a timeout,
    or a second process racing the first) returns the deliveries already sent,
    ``created`` False, and stores nothing; with another message under that key it
    raises ``IdempotencyConflict``. The same content is equal text, or a JSON value
    equal as PostgreSQL's ``jsonb`` compares them (key order and ``1.0``/``1`` aside).

    ``run_id`` / ``workflow_id`` name an existing run or workflow to send in (the key
    is then the step id in that run); ``message_event_id`` sends an existing event
    instead of ``content``. The deliveries' ``definition_event_id`` is the given one,
    else the run's, else the workflow's, else the message's own id; their ``cause`` is
    the given one, else the message event (``EventCause``)."""
    community_id = as_uuid("community_id", community_id)
    key = _key(idempotency_key)
    given_event = _optional_bytes32("message_event_id", message_event_id)
    content_text = None
    if given_event is None:
        content_kind, content_text = encode_content(content, content_kind)
    elif (
        content is not None
        or content_kind is not None
        or tags is not None
        or sender is not None
        or kind != MESSAGE_KIND
    ):
        raise ProtocolError(
            "message_event_id",
            "an existing event is sent as it is: no content, kind, tags or sender",
        )
    request = {
        "targets": _targets(targets),
        "content": content_text,
        "content_kind": content_kind,
        "kind": _kind(kind),
        "tags": _tags(_few_enough(tags)),
        "sender": UNSIGNED_SENDER if sender is None else _public_key("sender", sender),
        "message_event_id": given_event,
    }
    _bounded(request)
    definition = _optional_bytes32("definition_event_id", definition_event_id)
    cause = _cause(cause)
    run = _derived_run_id(community_id, key, using) if run_id is None else as_uuid("run_id", run_id)
    workflow = None if workflow_id is None else as_uuid("workflow_id", workflow_id)

    with delivery_identity(community_id, run, key, using=using) as identity:
        if identity.exists:
            return _already_sent(community_id, run, key, request, using)
        # Every write below commits with the deliveries or rolls back with them.
        with database_errors():
            now = _database_now(community_id, using)
            stored_run = _run(community_id, run, run_id is not None, workflow, using)
            if given_event is None:
                message = _new_message(community_id, run, key, request, now, using)
            else:
                message = _existing_message(community_id, given_event, request["targets"], using)
        if definition is None:
            definition = stored_run.definition_event_id or _workflow_definition(
                community_id, stored_run.workflow_id, using
            )
        binding = {
            "community_id": community_id,
            "workflow_id": stored_run.workflow_id,
            "run_id": run,
            "step_id": key,
            "definition_event_id": bytes(definition) if definition else message.id,
            "message_event_id": message.id,
            "cause": cause or EventCause(message.id),
        }
        identity.commit(
            message.created_at,
            [
                NewDelivery(DeliveryBinding(target_pubkey=target, **binding))
                for target in request["targets"]
            ],
        )
        records = _records(community_id, run, key, using)
    return SentMessage(
        run_id=run,
        step_id=key,
        message=message,
        deliveries=_in_target_order(records, request["targets"]),
        created=True,
    )


def _workflow_definition(community_id: UUID, workflow_id: UUID, using: str) -> bytes | None:
    return (
        Workflow.objects.using(using)
        .filter(community_id=community_id, id=workflow_id)
        .values_list("definition_event_id", flat=True)
        .first()
    )
