"""The operator's actions on deliveries (the admin's release, fail and retry, and
``retry_deliveries``): bulk updates in one community, recorded on the timeline as done
by the named operator."""

from __future__ import annotations

from collections.abc import Iterable
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..exceptions import ProtocolError
from ..models import REASON_MAX_LENGTH
from ..protocol import as_uuid
from ..store import run, statements
from ..store.statement import Statement
from ..validation import checked_operator


def _operator_update(
    statement: Statement,
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    operator: str | None,
    using: str,
) -> list[UUID]:
    community_id = as_uuid("community_id", community_id)
    ids = [as_uuid("delivery_id", value) for value in delivery_ids]
    actor = "operator" if operator is None else f"operator:{checked_operator(operator)}"
    if not ids:
        return []
    # The statement writes its timeline entries itself, by ``actor``.
    params = {"community_id": community_id, "delivery_ids": ids, "actor": actor}
    return [row[0] for row in run.fetch(using, statement, params)]


def release_deliveries(
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    *,
    operator: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Operator release: claimed rows of an active community go back to pending with
    the fence bumped, so their live holders are fenced out. Returns the ids released.
    The timeline records the actor as ``operator:<operator>``."""
    return _operator_update(statements.RELEASE, community_id, delivery_ids, operator, using)


def fail_deliveries(
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    *,
    operator: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Operator terminal: pending or claimed rows of an active community become
    ``failed``. Returns the ids marked. The timeline records ``operator:<operator>``."""
    return _operator_update(statements.MARK_FAILED, community_id, delivery_ids, operator, using)


def _reason(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError("reason", f"must be a non-blank text, not {value!r}")
    if len(value) > REASON_MAX_LENGTH or "\x00" in value:
        raise ProtocolError("reason", f"must be at most {REASON_MAX_LENGTH} characters, no NUL")
    return value


def retry_failed_deliveries(
    community_id: UUID | str,
    delivery_ids: Iterable[UUID | str],
    *,
    operator: str,
    reason: str,
    using: str = DEFAULT_DB_ALIAS,
) -> list[UUID]:
    """Operator retry: ``failed`` rows of an active community go back to pending, to be
    claimed at once, with the fence bumped and the attempts budget renewed (the cap
    counts the claims from now on). A ``finished`` row is never reopened (PostgreSQL
    refuses it). Returns the ids retried; the timeline records ``operator:<operator>``
    and ``reason``."""
    community_id = as_uuid("community_id", community_id)
    ids = [as_uuid("delivery_id", value) for value in delivery_ids]
    params = {
        "community_id": community_id,
        "delivery_ids": ids,
        "actor": f"operator:{checked_operator(operator)}",
        "reason": _reason(reason),
    }
    if not ids:
        return []
    return [row[0] for row in run.fetch(using, statements.OPERATOR_RETRY, params)]
