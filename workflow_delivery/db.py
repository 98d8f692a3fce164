"""The machinery under the operations: the cursor the app's statements run on, the
decoding of a delivery row into its record, and the compiled claim statement.

``services`` says *what* each operation does; this module says how a statement reaches
PostgreSQL and how its answer comes back.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connections, transaction
from django.db.models.expressions import RawSQL

from . import sql
from .conf import app_settings
from .models import WorkflowAgentDelivery
from .protocol import (
    CauseKind,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    EventCause,
    ScheduleCause,
    WebhookCause,
)

try:
    import psycopg
except ImportError:  # Django on psycopg2: the app's statements use Django's cursor.
    psycopg = None

_NEVER_BY_COUNT = 2**31 - 1

logger = logging.getLogger(__name__)

# Per raw connection: does a pooler sit between it and the server? Asked once.
_POOLED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_POOLER_REPORTED: set[str] = set()


def _behind_pooler(raw: Any, alias: str) -> bool:
    """True when the backend that answers is not the one the connection was opened to.

    A server tells its client the process id of the backend it started for it
    (BackendKeyData); a pooler that hands server connections out per transaction
    (PgBouncer, Odyssey, PgCat, Supavisor) makes one up, since the backend changes
    under the client. A prepared statement lives in one backend under a name chosen by
    its client, so behind such a pooler a name this client prepared may denote another
    client's statement on the backend that runs it: never prepare there.
    """
    pooled = _POOLED.get(raw)
    if pooled is None:
        # A plain, unprepared statement; in a caller's transaction it reads nothing
        # and writes nothing.
        with raw.cursor() as probe:
            probe.execute("SELECT pg_backend_pid()", prepare=False)
            (serving,) = probe.fetchone()
        pooled = _POOLED[raw] = serving != raw.info.backend_pid
        if pooled and alias not in _POOLER_REPORTED:
            _POOLER_REPORTED.add(alias)
            logger.warning(
                "database %r: the connection was opened to backend %s but backend %s "
                "answers, so a connection pooler sits in between; workflow_delivery "
                "will not prepare its statements on this database",
                alias,
                raw.info.backend_pid,
                serving,
            )
    return pooled


if psycopg is not None:

    class _PreparedCursor(psycopg.Cursor):
        """Server-side binding, binary results; each statement prepared once per connection."""

        def execute(self, query, params=None, **kwargs):  # type: ignore[override]
            return super().execute(query, params, prepare=True, binary=True)

    class _UnpreparedCursor(psycopg.Cursor):
        """The same statements, never prepared, whatever the connection's threshold."""

        def execute(self, query, params=None, **kwargs):  # type: ignore[override]
            return super().execute(query, params, prepare=False, binary=True)


@contextmanager
def cursor(using: str, *, savepoint: bool = True) -> Iterator[Any]:
    """A cursor for the app's own statements, with database errors made domain errors.

    With ``WORKFLOW_DELIVERY_PREPARED_STATEMENTS`` (the default) and psycopg 3, the
    statements go straight to psycopg on Django's connection, bound server-side and
    prepared, so PostgreSQL parses and plans each one once per connection rather than
    per call; they then do not appear in ``connection.queries``. Otherwise Django's
    cursor is used. On a connection that reaches its server through a pooler they are
    never prepared, whatever this setting or the host's psycopg options say.
    """
    wrapper = connections[using]
    # Each statement is atomic on its own in autocommit; inside a caller's transaction
    # a savepoint keeps a refused statement from aborting the caller's work.
    scope = transaction.atomic(using=using) if savepoint and wrapper.in_atomic_block else None
    with scope or nullcontext():
        # The checks Django's own cursor() makes before handing out a cursor.
        wrapper.close_if_health_check_failed()
        wrapper.ensure_connection()
        raw = wrapper.connection
        # Django's cursor makes these checks too; here they come before the probe.
        wrapper.validate_thread_sharing()
        wrapper.validate_no_broken_transaction()
        native = psycopg is not None and isinstance(raw, psycopg.Connection)
        pooled = False
        # Ask about a pooler wherever anything may be prepared: the app's statements,
        # or every statement once the host set psycopg's prepare_threshold.
        if native and (app_settings.PREPARED_STATEMENTS or raw.prepare_threshold is not None):
            with wrapper.wrap_database_errors:
                pooled = _behind_pooler(raw, using)
        if pooled:
            # Behind a pooler, whatever the settings: never under a prepared name.
            with sql.database_errors(), wrapper.wrap_database_errors, _UnpreparedCursor(raw) as c:
                yield c
            return
        if not (native and app_settings.PREPARED_STATEMENTS):
            with sql.database_errors(), wrapper.cursor() as cursor:
                yield cursor
            return
        if raw.prepare_threshold is None:
            # Django turns psycopg's preparation off; a threshold no query reaches
            # turns it back on for statements asked to prepare, and only for those.
            raw.prepare_threshold = _NEVER_BY_COUNT
        with sql.database_errors(), wrapper.wrap_database_errors, _PreparedCursor(raw) as c:
            yield c


def cause_columns(binding: DeliveryBinding) -> list[object]:
    cause = binding.cause
    return [
        cause.kind.value,
        cause.event_id if isinstance(cause, EventCause) else None,
        cause.scheduled_for if isinstance(cause, ScheduleCause) else None,
        cause.invocation_id if isinstance(cause, WebhookCause) else None,
    ]


def _cause(kind: str, event_id: bytes | None, scheduled_for, invocation_id):
    if kind == CauseKind.EVENT:
        return EventCause(bytes(event_id))
    if kind == CauseKind.SCHEDULE:
        return ScheduleCause(scheduled_for)
    return WebhookCause(invocation_id)


def record(row: Sequence) -> DeliveryRecord:
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
    ) = row
    binding = DeliveryBinding(
        community_id=community_id,
        workflow_id=workflow_id,
        run_id=run_id,
        step_id=step_id,
        target_pubkey=bytes(target_pubkey),
        definition_event_id=bytes(definition_event_id),
        message_event_id=bytes(message_event_id),
        cause=_cause(cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id),
    )
    return DeliveryRecord(
        id=id_,
        binding=binding,
        status=DeliveryStatus(status),
        lease_generation=lease_generation,
        lease_until=lease_until,
        claimed_at=claimed_at,
        finished_at=finished_at,
        created_at=created_at,
        message_event_created_at=message_event_created_at,
    )


# A literal, not a parameter: a prepared (generic) plan can then use the partial
# claim index, whose predicate is status = 'pending'.
_PENDING = RawSQL("'pending'", ())


def _claim_queryset(filters: dict[str, object], using: str):
    # The oldest pending row nobody else holds: a locked row is someone else's
    # claim in flight, so skip it rather than queue behind it.
    rows = WorkflowAgentDelivery.objects.using(using).filter(status=_PENDING, **filters)
    return rows.order_by("created_at", "id").select_for_update(skip_locked=True).values("id")[:1]


def _placeholder(position: int, value: object) -> object:
    """A value of ``value``'s type that no other filter of the same claim carries."""
    if isinstance(value, UUID):
        return UUID(int=position + 1)
    if isinstance(value, bytes):
        return position.to_bytes(32, "big")
    if isinstance(value, datetime):
        return datetime(2000, 1, 1, tzinfo=UTC) + timedelta(seconds=position)
    return f"claim-parameter-{position}"


def _adapted(param: object) -> object:
    """The value a driver's wrapper carries: Django hands bytes to psycopg 3 as
    ``psycopg.Binary`` (``.obj``) and to psycopg2 as ``psycopg2.extensions.Binary``
    (``.adapted``)."""
    for attribute in ("obj", "adapted"):
        if hasattr(param, attribute):
            return getattr(param, attribute)
    return param


# Claim statements compiled from the queryset, by (alias, filtered fields). Building
# and compiling the queryset cost more than the claim itself; only its shape decides
# the SQL, so each shape is compiled once, with placeholders that reveal which
# filter feeds which parameter.
_CLAIM_STATEMENTS: dict[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]] = {}


def claim_statement(filters: dict[str, object], using: str) -> tuple[str, list[object]]:
    shape = (using, tuple(filters))
    compiled = _CLAIM_STATEMENTS.get(shape)
    if compiled is None:
        placeholders = {
            name: _placeholder(position, value)
            for position, (name, value) in enumerate(filters.items())
        }
        queryset = _claim_queryset(placeholders, using)
        # Django compiles FOR UPDATE only inside a transaction; nothing runs here.
        with transaction.atomic(using=using):
            select_sql, params = queryset.query.get_compiler(using=using).as_sql()
        field_of = {value: name for name, value in placeholders.items()}
        order = tuple(field_of[_adapted(param)] for param in params)
        compiled = _CLAIM_STATEMENTS[shape] = (sql.claim_statement(select_sql), order)
    statement, order = compiled
    return statement, [filters[name] for name in order]
