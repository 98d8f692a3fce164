"""Where the app's statements run, through ``fetch`` (``fetch_count`` for a count of
rows changed), the one way the app runs SQL: the connection's lane in autocommit,
else a prepared psycopg cursor (or Django's) under a savepoint of its own, with
database errors made domain errors (``store.errors``). What the store knows of a
database session is one ``Session``, kept with the driver's connection; what it needs
of Django's connection beyond the documented API it asks ``store.django_adapter``.

``services`` says *what* each operation does; this module says how a statement
(``store.statements``) reaches PostgreSQL and how its rows come back.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

from django.db import DatabaseError, connections, transaction

from ..conf import app_settings
from . import django_adapter as django
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

_POOLER_REPORTED: set[str] = set()


class Session:
    """What the app knows of one database session, kept with its driver connection.

    What lives in a session belongs to the driver's connection, not to Django's
    wrapper of it: a connection pool (Django's ``OPTIONS={"pool": ...}``) hands one
    session to many wrappers in turn, and its prepared statements and settings go
    with it; a wrapper that reconnects has a new session, and so a fresh ``Session``.
    """

    __slots__ = ("bare", "cursor", "lane", "pooled", "timeline")

    def __init__(self) -> None:
        # Does a pooler sit between this connection and the server? Asked once.
        self.pooled: bool | None = None
        # The lane of this connection's autocommit statements, made on first use.
        self.lane: _lane.Lane | None = None
        # Whether the timeline trigger records, as the session was last told; it
        # records until told otherwise (the database's default).
        self.timeline = True
        # The prepared cursor the cursor path lends to one statement at a time.
        self.cursor: Any = None
        # Inside ``one_transaction``: False, True once a statement failed; else None.
        self.bare: bool | None = None


_SESSIONS: weakref.WeakKeyDictionary[Any, Session] = weakref.WeakKeyDictionary()


def session_of(wrapper: Any, raw: Any) -> Session:
    """The ``Session`` of the driver's connection ``raw``, which ``wrapper`` (Django's)
    holds, made on first use. A connection that takes no weak reference gets a fresh
    one each time: nothing is remembered (every statement tells the session its
    timeline, takes its own cursor and savepoint), which is slower but right."""
    try:
        session = _SESSIONS.get(raw)
    except TypeError:
        return Session()
    if session is None:
        session = _SESSIONS[raw] = Session()
        _forget_sessions_of_closed_connections()
        if not django.pooled(wrapper):
            # The session's lane and cursor hold ``raw``, so its entry would keep it
            # alive: forget it with the wrapper (a thread's, dropped with the thread
            # and never closed). A pool's connections outlive the wrappers that use
            # them, with their prepared statements; the pool closes them.
            weakref.finalize(wrapper, _forget, weakref.ref(raw))
    return session


def _forget(raw_ref: weakref.ref) -> None:
    raw = raw_ref()
    if raw is not None:
        _SESSIONS.pop(raw, None)


def _forget_sessions_of_closed_connections() -> None:
    for raw in [raw for raw in _SESSIONS if getattr(raw, "closed", False)]:
        _SESSIONS.pop(raw, None)


def _behind_pooler(wrapper: Any, raw: Any, session: Session, alias: str) -> bool:
    """True when the backend that answers is not the one the connection was opened to.

    A server tells its client the process id of the backend it started for it
    (BackendKeyData); a pooler that hands server connections out per transaction
    (PgBouncer, Odyssey, PgCat, Supavisor) makes one up, since the backend changes
    under the client. A prepared statement lives in one backend under a name chosen by
    its client, so behind such a pooler a name this client prepared may denote another
    client's statement on the backend that runs it: never prepare there.
    """
    pooled = session.pooled
    if pooled is None:
        # A plain, unprepared statement; in a caller's transaction it reads nothing
        # and writes nothing.
        with django.as_django_errors(wrapper), raw.cursor() as probe:
            probe.execute("SELECT pg_backend_pid()", prepare=False)
            (serving,) = probe.fetchone()
        pooled = session.pooled = serving != raw.info.backend_pid
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
    wrapper: Any, session: Session, send: Callable[[Statement, list[object]], object]
) -> None:
    """Tell this session whether the timeline trigger records (``WORKFLOW_DELIVERY_TIMELINE``),
    by ``send(statement, args)``. A session setting, sent once per connection and again
    only when the setting changes or a statement run through Django reset the
    session's settings (``RESET``, ``DISCARD ALL``: ``_notice_session_reset``); a
    session that never hears it records (the database's default)."""
    wanted = bool(app_settings.TIMELINE)
    if session.timeline == wanted:
        return
    send(
        statements.SET_TIMELINE,
        statements.SET_TIMELINE.args({"timeline": "on" if wanted else "off"}),
    )
    session.timeline = wanted
    django.keep_execute_wrapper(wrapper, _notice_session_reset)


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
        raw = django.raw(wrapper)
        if raw is not None:
            # Back to the database's default, which records.
            session_of(wrapper, raw).timeline = True
    return result


def _send_through_django(wrapper: Any) -> Callable[[Statement, list[object]], object]:
    def send(statement: Statement, args: list[object]) -> None:
        with wrapper.cursor() as setter:
            setter.execute(statement.sql, args)

    return send


class _Scope:
    """One use of a cursor for one statement: its savepoint, Django's checks, the
    cursor itself, and the translation of database errors, entered and left without
    the nested context managers a statement would otherwise pay for twice over."""

    __slots__ = ("_atomic", "_cursor", "_django", "_reused", "_savepoint", "_session", "_using")
    __slots__ += ("_wrapper",)

    def __init__(self, using: str, savepoint: bool) -> None:
        self._using = using
        self._savepoint = savepoint

    def __enter__(self) -> Any:
        wrapper = self._wrapper = connections[self._using]
        self._atomic = None
        self._session = None
        if self._savepoint and django.in_transaction(wrapper):
            raw = django.raw(wrapper)
            if raw is None or session_of(wrapper, raw).bare is None:
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
        raw = django.connect(wrapper)
        session = self._session = session_of(wrapper, raw)
        _sync_timeline(wrapper, session, _send_through_django(wrapper))
        self._cursor = self._django = None
        self._reused = False
        native = psycopg is not None and isinstance(raw, psycopg.Connection)
        if native:
            django.check_statement(wrapper)
            # Ask about a pooler wherever anything may be prepared: the app's
            # statements, or every statement once the host set prepare_threshold.
            preparing = app_settings.PREPARED_STATEMENTS or raw.prepare_threshold is not None
            if preparing and _behind_pooler(wrapper, raw, session, self._using):
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
        # cursor's own work, so each session lends out one. A fresh one (closed
        # after) when that one is lent already or Django lets threads share the
        # connection: no two statements ever read each other's results.
        reused = session.cursor
        if django.shared_between_threads(wrapper) or (reused is not None and reused.lent):
            self._cursor = _PreparedCursor(raw)
            return self._cursor
        if reused is None or reused.closed:
            reused = session.cursor = _PreparedCursor(raw)
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
                django.as_django_errors(self._wrapper).__exit__(exc_type, exc, tb)
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
        session = self._session
        if final is not None and session is not None and session.bare is not None:
            session.bare = True
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
        elif self._cursor is not None:
            self._cursor.close()

    def _leave_atomic(self, exc: BaseException | None) -> None:
        if self._atomic is not None:
            atomic, self._atomic = self._atomic, None
            if exc is None:
                atomic.__exit__(None, None, None)
            else:
                atomic.__exit__(type(exc), exc, exc.__traceback__)


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
    raw = django.raw(wrapper) if django.in_transaction(wrapper) else None
    if raw is not None and session_of(wrapper, raw).bare is not None:
        yield
        return
    # The caller's statements and its replay-guard row commit together or not at all.
    with transaction.atomic(using=using):
        session = session_of(wrapper, django.raw(wrapper))
        session.bare = False
        try:
            yield
            failed = session.bare and not transaction.get_rollback(using=using)
        finally:
            session.bare = None
        if failed:
            raise TransactionAborted("a statement failed in a transaction that went on to commit")


def _lane_for(wrapper: Any, using: str) -> tuple[_lane.Lane, Session] | None:
    """The connection's lane and session, when a statement outside any transaction
    may take the lane: psycopg 3 with the app's statements prepared
    (``WORKFLOW_DELIVERY_PREPARED_STATEMENTS``), the session in autocommit and idle,
    this thread the connection's only user. Anything else takes the cursor path,
    which does or refuses it the way Django's cursor would.

    Only autocommit: psycopg answers every ROLLBACK it runs (a savepoint's too) with a
    DEALLOCATE ALL, which also drops the lane's statements. Outside a transaction the
    lane notices (``lane.Lane.run``) and prepares again, since nothing ran; inside one
    the failed statement would already have aborted the caller's transaction."""
    if not (_lane.AVAILABLE and app_settings.PREPARED_STATEMENTS):
        return None
    if django.health_check_pending(wrapper):
        return None
    # Refuses inside an event loop, as Django's cursor() does; opens a closed connection.
    raw = django.connect(wrapper)
    session = session_of(wrapper, raw)
    lane = session.lane
    if lane is None:
        if not isinstance(raw, psycopg.Connection):
            return None
        pooled = _behind_pooler(wrapper, raw, session, using)
        lane = session.lane = _lane.Lane(raw, prepare=not pooled)
    # A connection shared between threads takes the cursor path (one cursor per
    # statement, psycopg's lock around it); another thread's connection is refused
    # here, as Django's cursor would refuse it.
    if django.shared_between_threads(wrapper):
        return None
    django.check_thread(wrapper)
    if lane.transaction_status != _lane.IDLE or not raw.autocommit:
        return None
    return lane, session


def _raise_mapped(wrapper: Any, exc: BaseException) -> NoReturn:
    """Raise ``exc`` (psycopg's) as Django's cursor would have (which also marks the
    connection for Django's end-of-request check), then as its domain error if any."""
    try:
        with django.as_django_errors(wrapper):
            raise exc
    except DatabaseError as translated:
        raise_domain_error(translated)
        raise


def fetch(
    using: str,
    statement: Statement,
    params: Mapping[str, object] | None = None,
    *,
    savepoint: bool = True,
) -> list[tuple]:
    """Run one of the app's statements with ``params`` (by name) and return every row
    it answers (none for a statement that answers no rows), with database errors made
    domain errors. The one way the app runs SQL (``fetch_count`` is its sibling for
    a count of rows changed).

    In autocommit the statement is its own transaction, sent through the connection's
    lane (``lane.Lane``) when it may take it. Inside the caller's transaction it runs
    on a cursor, under a savepoint of its own unless ``savepoint`` is false, so a
    refused statement leaves the caller's work usable.

    With ``WORKFLOW_DELIVERY_PREPARED_STATEMENTS`` (the default) and psycopg 3, the
    statements go straight to psycopg on Django's connection, bound server-side and
    prepared, so PostgreSQL parses and plans each one once per connection rather than
    per call; they then do not appear in ``connection.queries``. Otherwise Django's
    cursor is used. On a connection that reaches its server through a pooler they are
    never prepared, whatever this setting or the host's psycopg options say."""
    args = statement.args(params)
    wrapper = connections[using]
    taken = None if django.in_transaction(wrapper) else _lane_for(wrapper, using)
    if taken is None:
        with _Scope(using, savepoint) as cursor:
            cursor.execute(statement.sql, args)
            return cursor.fetchall() if cursor.description is not None else []
    lane, session = taken
    try:
        _sync_timeline(wrapper, session, lane.run)
        return lane.run(statement, args)
    except psycopg.Error as exc:
        _raise_mapped(wrapper, exc)


def fetch_count(
    using: str,
    statement: Statement,
    params: Mapping[str, object] | None = None,
    *,
    savepoint: bool = True,
) -> int:
    """``fetch``, for a statement whose answer is how many rows it changed (a
    ``DELETE`` with no ``RETURNING``): that count. Always on a cursor, in autocommit
    or in the caller's transaction (under a savepoint unless ``savepoint`` is false)."""
    args = statement.args(params)
    with _Scope(using, savepoint) as cursor:
        cursor.execute(statement.sql, args)
        return cursor.rowcount
