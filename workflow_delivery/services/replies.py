"""An agent's reply to a delivery it holds: a message of the same run, tagged as a
reply to the delivered message (``["e", <message id>, "", "reply"]``), sent by the
holder's key to enrolled agents of the community, committed only under the live
lease; and the replies a run holds so far.

The reply's step (its idempotency key in the run) is derived from the delivery and
the caller's key, so the same reply asked again, under this lease or a later one of
the same delivery, sends once."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..conf import app_settings
from ..exceptions import LeaseNotLive, ProtocolError
from ..models import Event
from ..protocol import Lease, MessageEvent, SentMessage, as_uuid
from .holder import get_delivery, holding, message_events
from .sending import send_message

__all__ = ["REPLY_MARKER", "reply_to_delivery", "run_replies", "send_reply"]

REPLY_MARKER = "reply"
# The most replies ``run_replies`` reads.
MAX_REPLIES = 100
# The longest idempotency key a caller may give (the step id is its digest).
MAX_REPLY_KEY = 200


def _content(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError("content", "must be a non-empty string")
    limit = app_settings.ACP_REPLY_BYTES
    size = len(value.encode())
    if size > limit:
        raise ProtocolError("content", f"is {size} bytes; a reply may have at most {limit}")
    return value


def _to(value: object) -> list[str]:
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Iterable)
        or not (keys := list(value))
        or not all(isinstance(key, str) for key in keys)
    ):
        raise ProtocolError("to", "must name at least one agent key (64 hex characters)")
    return keys


def _reply_step(delivery_id: UUID, idempotency_key: object) -> str:
    """The step id of a reply: derived from the delivery and the caller's key."""
    if not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= MAX_REPLY_KEY:
        raise ProtocolError(
            "idempotency_key", f"must be a string of 1 to {MAX_REPLY_KEY} characters"
        )
    digest = hashlib.sha256(f"{delivery_id}|{idempotency_key}".encode()).hexdigest()
    return f"{REPLY_MARKER}-{digest[:48]}"


def send_reply(
    lease: Lease,
    *,
    message: MessageEvent,
    run_id: UUID,
    content: object,
    to: object,
    idempotency_key: str,
    using: str = DEFAULT_DB_ALIAS,
) -> SentMessage:
    """Send the holder's reply to ``message`` (the delivery's) in ``run_id``. Call it
    inside ``holding(lease)`` (or ``DeliveryContext.holding()``): the block makes it
    commit only under the live lease. Bad content, or ``to`` naming a key outside the
    roster, is an error and sends nothing."""
    content = _content(content)
    targets = _to(to)
    return send_message(
        lease.community_id,
        targets=targets,
        content=content,
        idempotency_key=_reply_step(lease.delivery_id, idempotency_key),
        run_id=run_id,
        tags=[["e", message.id.hex(), "", REPLY_MARKER]],
        sender=lease.target_pubkey,
        using=using,
    )


def reply_to_delivery(
    lease: Lease,
    *,
    content: object,
    to: object,
    idempotency_key: str,
    using: str = DEFAULT_DB_ALIAS,
) -> SentMessage:
    """``send_reply`` in its own ``holding(lease)`` block: a lease that is not live
    (reaped, released, superseded, settled) raises ``LeaseNotLive`` and stores
    nothing."""
    _content(content)
    _to(to)
    _reply_step(lease.delivery_id, idempotency_key)
    with holding(lease, using=using):
        record = get_delivery(lease.community_id, lease.delivery_id, using=using)
        if record is None or record.binding.target_pubkey != lease.target_pubkey:
            raise LeaseNotLive(lease)
        message = message_events(lease.community_id, [record], using=using).get(record.id)
        if message is None:
            raise ProtocolError("delivery_id", "the delivery's message is no longer stored")
        return send_reply(
            lease,
            message=message,
            run_id=record.binding.run_id,
            content=content,
            to=to,
            idempotency_key=idempotency_key,
            using=using,
        )


def run_replies(
    community_id: UUID | str, run_id: UUID | str, *, using: str = DEFAULT_DB_ALIAS
) -> list[dict[str, str]]:
    """The replies stored in the run so far, oldest first (at most ``MAX_REPLIES``):
    each its event id, content and sender (hex)."""
    community_id = as_uuid("community_id", community_id)
    run_id = as_uuid("run_id", run_id)
    rows = (
        Event.objects.using(using)
        .filter(community_id=community_id, tags__contains=[["run", str(run_id)]])
        .order_by("created_at")
        .values_list("id", "content", "pubkey", "tags")
    )
    found = []
    for event_id, content, pubkey, tags in rows.iterator():
        if any(tag[:1] == ["e"] and tag[-1:] == [REPLY_MARKER] for tag in tags):
            found.append(
                {"id": bytes(event_id).hex(), "content": content, "pubkey": bytes(pubkey).hex()}
            )
            if len(found) >= MAX_REPLIES:
                break
    return found
