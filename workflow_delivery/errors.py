"""The classification of database errors, decided in one place: is this a lost
session, a timeout?

* *connection lost*: the session is gone (class 08, the server shutting down or
  restarting, 57P01 to 57P03, or the session ended by
  ``idle_in_transaction_session_timeout``, 25P03, ``idle_session_timeout``, 57P05,
  or ``transaction_timeout``, 25P04), or the error came with the connection closed,
  whatever its SQLSTATE: reconnect and retry.
* *timeout*: ``lock_timeout`` (55P03) or ``statement_timeout`` / a cancel (57014):
  the statement was cancelled and the session is fine.

``store.errors`` translates the rest (the app's constraints) into named facts.
"""

from __future__ import annotations

from typing import Any

from django.db import Error as DatabaseError
from django.db import InterfaceError, OperationalError

try:
    import psycopg
except ImportError:  # Django on psycopg2
    psycopg = None

__all__ = [
    "CONNECTION_ERRORS",
    "CONNECTION_LOST_STATES",
    "TIMEOUT_STATES",
    "is_closed",
    "is_connection_lost",
    "is_timeout",
    "sqlstate",
]

CONNECTION_LOST_STATES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "25P04"})
TIMEOUT_STATES = frozenset({"55P03", "57014"})

# The errors a lost session surfaces as (Django's, and psycopg's own below Django).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)
_DRIVER_ERRORS: tuple[type[BaseException], ...] = ()
if psycopg is not None:
    CONNECTION_ERRORS += (psycopg.OperationalError, psycopg.InterfaceError)
    _DRIVER_ERRORS += (psycopg.Error,)


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error or of the Django error wrapping one."""
    for candidate in (exc, exc.__cause__):
        if candidate is None:
            continue
        code = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if code:
            return str(code)
    return None


def is_connection_lost(exc: BaseException, connection: Any = None) -> bool:
    """True when ``exc`` says the session is gone, so reconnecting is the cure. A
    driver error without a SQLSTATE (the socket closed, the connection already
    closed) counts as lost; a cancelled statement or a refused one does not.

    ``connection`` (a Django connection, or a driver's) is the one the failed
    statement ran on: a database error that left it closed is a lost session
    whatever its SQLSTATE (a server that ends a session for a reason this module
    does not know of yet)."""
    code = sqlstate(exc)
    if code is None:
        return isinstance(exc, CONNECTION_ERRORS)
    if code.startswith("08") or code in CONNECTION_LOST_STATES:
        return True
    return isinstance(exc, (DatabaseError, *_DRIVER_ERRORS)) and is_closed(connection)


def is_closed(connection: Any) -> bool:
    """True when ``connection`` (a Django connection, or a driver's) was open and its
    driver now reports it closed or broken. A Django connection never opened, or
    closed by Django, is not: nothing failed on it."""
    raw = getattr(connection, "connection", connection)
    if raw is None:
        return False
    return bool(getattr(raw, "closed", False)) or bool(getattr(raw, "broken", False))


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` is a statement cancelled by lock_timeout or statement_timeout."""
    return sqlstate(exc) in TIMEOUT_STATES
