"""Where the app's statements run: the connection's lane in autocommit, else a
prepared psycopg cursor (or Django's) under a savepoint of its own, with database
errors made domain errors (``store.errors``).

``services`` says *what* each operation does; this module says how a statement
(``store.statements``) reaches PostgreSQL and how its rows come back.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

from django.db import DatabaseError, connections, transaction

from ..conf import app_settings
from . import lane as _lane
from . import statements
from .errors import raise_domain_error
from .statement import Statement

try:
    import psycopg
except ImportError:  # Django on psycopg2: the app's statements use Django's cursor.
    psycopg = None

_NEVER_BY_COUNT = 2**31 - 1

logger = logging.getLogger(__name__)

# Per raw connection: does a pooler sit between it and the server? Asked once.
_POOLED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_POOLER_REPORTED: set[str] = set()

# What lives in a session belongs to the raw connection, not to Django's wrapper of
# it: a connection pool (Django's ``OPTIONS={"pool": ...}``) hands one session to many
# wrappers in turn, and its prepared statements and settings go with it.
_LANES: weakref.WeakKeyDictionary[Any, _lane.Lane] = weakref.WeakKeyDictionary()
_TIMELINE_TOLD: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


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

        lent = False

        def execute(self, query, params=None, **kwargs):  # type: ignore[override]
            return super().execute(query, params, prepare=True, binary=True)

    class _UnpreparedCursor(psycopg.Cursor):
        """The same statements, never prepared, whatever the connection's threshold."""

        def execute(self, query, params=None, **kwargs):  # type: ignore[override]
            return super().execute(query, params, prepare=False, binary=True)


def _sync_timeline(
    wrapper: Any, raw: Any, send: Callable[[Statement, list[object]], object]
) -> None:
    """Tell this session whether the timeline trigger records (``WORKFLOW_DELIVERY_TIMELINE``),
    by ``send(statement, args)``. A session setting, sent once per connection and again
    only when the setting changes or a statement run through Django reset the
    session's settings (``RESET``, ``DISCARD ALL``: ``_notice_session_reset``); a
    session that never hears it records (the database's default)."""
    wanted = bool(app_settings.TIMELINE)
    try:
        recording = _TIMELINE_TOLD.get(raw, True)
        remember = True
    except TypeError:
        # A connection that takes no weak reference: remembered on the wrapper, which
        # is right as long as no pool hands the session to another wrapper.
        told = wrapper.__dict__.get("_wd_timeline")
        recording = told[1] if told is not None and told[0] == id(raw) else True
        remember = False
    if recording == wanted:
        return
    send(
        statements.SET_TIMELINE,
        statements.SET_TIMELINE.args({"timeline": "on" if wanted else "off"}),
    )
    if remember:
        _TIMELINE_TOLD[raw] = wanted
    else:
        wrapper._wd_timeline = (id(raw), wanted)
    if _notice_session_reset not in wrapper.execute_wrappers:
        # First of the wrappers: Django's execute_wrapper() blocks pop the last.
        wrapper.execute_wrappers.insert(0, _notice_session_reset)


# What a statement's command status is when it put the session's settings back to
# their defaults (RESET ALL, or RESET of one; DISCARD ALL).
_RESETS = frozenset({"RESET", "DISCARD ALL"})


def _notice_session_reset(
    execute: Callable, sql: Any, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """Django's execute wrapper on a connection the app told its timeline: a statement
    that reset the session's settings makes the app forget what it told, so its next
    statement tells the session again."""
    result = execute(sql, params, many, context)
    status = getattr(context["cursor"].cursor, "statusmessage", None)
    if status in _RESETS:
        wrapper = context["connection"]
        with suppress(TypeError):  # a connection that takes no weak reference
            _TIMELINE_TOLD.pop(wrapper.connection, None)
        wrapper.__dict__.pop("_wd_timeline", None)
    return result


def _send_through_django(wrapper: Any) -> Callable[[Statement, list[object]], object]:
    def send(statement: Statement, args: list[object]) -> None:
        with wrapper.cursor() as setter:
            setter.execute(statement.sql, args)

    return send


# Where a connection keeps the prepared cursor its statements reuse.
_REUSED = "_workflow_delivery_cursor"


class _Scope:
    """One use of the app's cursor: its savepoint, Django's checks, the cursor itself,
    and the translation of database errors, entered and left without the nested
    context managers a statement would otherwise pay for twice over."""

    __slots__ = ("_atomic", "_cursor", "_django", "_reused", "_savepoint", "_using", "_wrapper")

    def __init__(self, using: str, savepoint: bool) -> None:
        self._using = using
        self._savepoint = savepoint

    def __enter__(self) -> Any:
        wrapper = self._wrapper = connections[self._using]
        self._atomic = None
        if self._savepoint and wrapper.in_atomic_block and _BARE not in wrapper.__dict__:
            # Each statement is atomic on its own in autocommit; inside a caller's
            # transaction a savepoint keeps a refused statement from aborting the
            # caller's work.
            self._atomic = transaction.atomic(using=self._using)
            self._atomic.__enter__()
        try:
            return self._open(wrapper)
        except BaseException as exc:
            self._leave_atomic(exc)
            raise

    def _open(self, wrapper: Any) -> Any:
        # The checks Django's own cursor() makes before handing out a cursor (the
        # health check runs once per request; ensure_connection also refuses to run
        # inside an event loop).
        if wrapper.health_check_enabled and not wrapper.health_check_done:
            wrapper.close_if_health_check_failed()
        wrapper.ensure_connection()
        raw = wrapper.connection
        _sync_timeline(wrapper, raw, _send_through_django(wrapper))
        self._cursor = self._django = None
        self._reused = False
        native = psycopg is not None and isinstance(raw, psycopg.Connection)
        if native:
            # What Django's cursor checks on every execute: this thread may use the
            # connection, and the caller's transaction is not already broken.
            wrapper.validate_thread_sharing()
            wrapper.validate_no_broken_transaction()
            # Ask about a pooler wherever anything may be prepared: the app's
            # statements, or every statement once the host set prepare_threshold.
            if app_settings.PREPARED_STATEMENTS or raw.prepare_threshold is not None:
                with wrapper.wrap_database_errors:
                    pooled = _behind_pooler(raw, self._using)
                if pooled:
                    # Behind a pooler, whatever the settings: never under a prepared name.
                    self._cursor = _UnpreparedCursor(raw)
                    return self._cursor
        if not (native and app_settings.PREPARED_STATEMENTS):
            try:
                self._django = wrapper.cursor()
            except Exception as exc:
                raise_domain_error(exc)
                raise
            return self._django
        if raw.prepare_threshold is None:
            # Django turns psycopg's preparation off; a threshold no query reaches
            # turns it back on for statements asked to prepare, and only for those.
            raw.prepare_threshold = _NEVER_BY_COUNT
        # Creating and closing a psycopg cursor per statement costs more than the
        # cursor's own work, so each connection lends out one. A fresh one (closed
        # after) when that one is lent to an enclosing scope or Django lets threads
        # share the connection: no two statements ever read each other's results.
        reused = wrapper.__dict__.get(_REUSED)
        if wrapper.allow_thread_sharing or (reused is not None and reused.lent):
            self._reused = False
            self._cursor = _PreparedCursor(raw)
            return self._cursor
        if reused is None or reused.connection is not raw or reused.closed:
            # The first statement on this (possibly re-opened) connection.
            reused = wrapper.__dict__[_REUSED] = _PreparedCursor(raw)
        reused.lent = True
        self._reused = True
        self._cursor = reused
        return reused

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        final = exc
        try:
            self._release(exc_type, exc, tb)
            if exc is not None and self._cursor is not None:
                # psycopg's error as Django's (which also marks the connection for
                # Django's end-of-request check), as Django's cursor would.
                self._wrapper.wrap_database_errors.__exit__(exc_type, exc, tb)
            if isinstance(exc, DatabaseError):
                raise_domain_error(exc)
        except DatabaseError as translated:
            final = translated
            try:
                raise_domain_error(translated)
            except BaseException as mapped:  # noqa: BLE001 - re-raised below
                final = mapped
        except BaseException as other:  # noqa: BLE001 - re-raised below
            final = other
        if final is not None and _BARE in self._wrapper.__dict__:
            self._wrapper.__dict__[_BARE] = True
        # The savepoint ends with the error the caller will see (rolled back) or none.
        self._leave_atomic(final)
        if final is not exc:
            raise final
        return False

    def _release(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._django is not None:
            self._django.__exit__(exc_type, exc, tb)
        elif self._reused:
            self._cursor.lent = False
        else:
            self._cursor.close()

    def _leave_atomic(self, exc: BaseException | None) -> None:
        if self._atomic is not None:
            atomic, self._atomic = self._atomic, None
            if exc is None:
                atomic.__exit__(None, None, None)
            else:
                atomic.__exit__(type(exc), exc, exc.__traceback__)


# Set on a wrapper inside ``one_transaction``: False, or True once a statement failed.
_BARE = "_workflow_delivery_one_transaction"


class TransactionAborted(DatabaseError):
    """A statement failed inside ``one_transaction`` and the caller went on as if
    it had not: the transaction cannot commit."""


@contextmanager
def one_transaction(using: str) -> Iterator[None]:
    """A transaction in which the app's statements take no savepoint each: for a
    caller that rolls all of it back on any refusal (``transaction.set_rollback``),
    such as one request of the agent API. Each savepoint would cost two round trips.
    A statement that fails leaves the transaction aborted; if the caller then
    carries on to commit, ``TransactionAborted`` is raised and nothing commits."""
    wrapper = connections[using]
    if _BARE in wrapper.__dict__:
        yield
        return
    # The caller's statements and its replay-guard row commit together or not at all.
    with transaction.atomic(using=using):
        wrapper.__dict__[_BARE] = False
        try:
            yield
            failed = wrapper.__dict__[_BARE] and not transaction.get_rollback(using=using)
        finally:
            del wrapper.__dict__[_BARE]
        if failed:
            raise TransactionAborted("a statement failed in a transaction that went on to commit")


def cursor(using: str, *, savepoint: bool = True) -> _Scope:
    """A cursor for the app's own statements, with database errors made domain errors.

    With ``WORKFLOW_DELIVERY_PREPARED_STATEMENTS`` (the default) and psycopg 3, the
    statements go straight to psycopg on Django's connection, bound server-side and
    prepared, so PostgreSQL parses and plans each one once per connection rather than
    per call; they then do not appear in ``connection.queries``. Otherwise Django's
    cursor is used. On a connection that reaches its server through a pooler they are
    never prepared, whatever this setting or the host's psycopg options say.
    """
    return _Scope(using, savepoint)


# Where a wrapper keeps the lane of its current raw connection (``_LANES`` owns it).
_LANE = "_workflow_delivery_lane"


def _lane_for(wrapper: Any, using: str) -> _lane.Lane | None:
    """The connection's lane, when a statement outside any transaction may take it:
    psycopg 3 with the app's statements prepared (``WORKFLOW_DELIVERY_PREPARED_STATEMENTS``),
    the session in autocommit and idle, this thread the connection's only user.
    Anything else takes the cursor path, which does or refuses it the way Django's
    cursor would.

    Only autocommit: psycopg answers every ROLLBACK it runs (a savepoint's too) with a
    DEALLOCATE ALL, which also drops the lane's statements. Outside a transaction the
    lane notices (``lane.Lane.run``) and prepares again, since nothing ran; inside one
    the failed statement would already have aborted the caller's transaction."""
    if not (_lane.AVAILABLE and app_settings.PREPARED_STATEMENTS):
        return None
    if wrapper.health_check_enabled and not wrapper.health_check_done:
        return None
    # Refuses inside an event loop, as Django's cursor() does; opens a closed connection.
    wrapper.ensure_connection()
    raw = wrapper.connection
    lane = wrapper.__dict__.get(_LANE)
    if lane is None or lane.raw is not raw:
        if not isinstance(raw, psycopg.Connection):
            return None
        # A session from a pool may carry the statements an earlier wrapper's lane
        # prepared on it: the lane that named them goes on with them.
        lane = _LANES.get(raw)
        if lane is None:
            with wrapper.wrap_database_errors:
                pooled = _behind_pooler(raw, using)
            lane = _LANES[raw] = _lane.Lane(raw, prepare=not pooled)
        wrapper.__dict__[_LANE] = lane
    # A connection shared between threads takes the cursor path (one cursor per
    # statement, psycopg's lock around it); another thread's connection is refused
    # here, as Django's cursor would refuse it.
    if wrapper.allow_thread_sharing:
        return None
    wrapper.validate_thread_sharing()
    if lane.transaction_status != _lane.IDLE or not raw.autocommit:
        return None
    return lane


def _raise_mapped(wrapper: Any, exc: BaseException) -> NoReturn:
    """Raise ``exc`` (psycopg's) as Django's cursor would have (which also marks the
    connection for Django's end-of-request check), then as its domain error if any."""
    try:
        with wrapper.wrap_database_errors:
            raise exc
    except DatabaseError as translated:
        raise_domain_error(translated)
        raise


def execute(cursor: Any, statement: Statement, params: Mapping[str, object] | None = None) -> None:
    """Send ``statement`` with ``params`` (by name) on a DB-API ``cursor``: one of
    ``cursor()``'s, or Django's own."""
    cursor.execute(statement.sql, statement.args(params))


def fetch(
    using: str,
    statement: Statement,
    params: Mapping[str, object] | None = None,
    *,
    savepoint: bool = True,
) -> list[tuple]:
    """Run one of the app's statements with ``params`` (by name) and return every row
    it answers, with database errors made domain errors.

    In autocommit the statement is its own transaction, sent through the connection's
    lane (``lane.Lane``) when it may take it. Inside the caller's transaction it runs
    on ``cursor()``, under a savepoint of its own unless ``savepoint`` is false, so a
    refused statement leaves the caller's work usable."""
    args = statement.args(params)
    wrapper = connections[using]
    lane = None if wrapper.in_atomic_block else _lane_for(wrapper, using)
    if lane is None:
        with _Scope(using, savepoint) as cursor:
            cursor.execute(statement.sql, args)
            return cursor.fetchall()
    try:
        _sync_timeline(wrapper, lane.raw, lane.run)
        return lane.run(statement, args)
    except psycopg.Error as exc:
        _raise_mapped(wrapper, exc)
