"""What a database error means to a caller, decided by its SQLSTATE in one place.

* *connection lost*: the session is gone (class 08, the server shutting down or
  restarting, 57P01 to 57P03, or the session killed by
  ``idle_in_transaction_session_timeout``, 25P03): reconnect and retry.
* *timeout*: ``lock_timeout`` (55P03) or ``statement_timeout`` / a cancel (57014):
  the statement was cancelled and the session is fine; ``sql.database_errors``
  raises ``DeliveryTimeout`` and the caller decides.
* anything else is not ours to classify: it is re-raised as it is.
"""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

try:
    import psycopg
except ImportError:  # Django on psycopg2
    psycopg = None

CONNECTION_LOST_STATES = frozenset({"57P01", "57P02", "57P03", "25P03"})
TIMEOUT_STATES = frozenset({"55P03", "57014"})

_DRIVER_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)
if psycopg is not None:
    _DRIVER_CONNECTION_ERRORS += (psycopg.OperationalError, psycopg.InterfaceError)


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error or of the Django error wrapping one."""
    for candidate in (exc, exc.__cause__):
        if candidate is None:
            continue
        code = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if code:
            return str(code)
    return None


def is_connection_lost(exc: BaseException) -> bool:
    """True when ``exc`` says the session is gone, so reconnecting is the cure. A
    driver error without a SQLSTATE (the socket closed, the connection already
    closed) counts as lost; a cancelled statement or a refused one does not."""
    code = sqlstate(exc)
    if code is None:
        return isinstance(exc, _DRIVER_CONNECTION_ERRORS)
    return code.startswith("08") or code in CONNECTION_LOST_STATES


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` is a statement cancelled by lock_timeout or statement_timeout."""
    return sqlstate(exc) in TIMEOUT_STATES
