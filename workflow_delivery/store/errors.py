"""What a database error means, decided in one place: a domain exception by the
constraint it names, a timeout by its SQLSTATE, or a lost session.

* *connection lost*: the session is gone (class 08, the server shutting down or
  restarting, 57P01 to 57P03, or the session ended by
  ``idle_in_transaction_session_timeout``, 25P03, ``idle_session_timeout``, 57P05,
  or ``transaction_timeout``, 25P04), or the error came with the connection closed,
  whatever its SQLSTATE: reconnect and retry.
* *timeout*: ``lock_timeout`` (55P03) or ``statement_timeout`` / a cancel (57014):
  the statement was cancelled and the session is fine (``DeliveryTimeout``).
* a constraint or trigger of the app (``wd_…``): its named fact.
* anything else is not ours to classify: it is re-raised as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from django.db import Error as DatabaseError
from django.db import InterfaceError, OperationalError

from ..counters import FENCE_REFUSALS
from ..exceptions import (
    CommunityNotFound,
    CommunityWriteFenced,
    ConstraintViolation,
    DeliveryConflict,
    DeliveryTimeout,
    InvalidLifecycleTransition,
    IsolationLevelError,
    ReferenceMissing,
    StepMessageConflict,
    TargetNotEnrolled,
)
from ..models import WorkflowAgentDelivery

try:
    import psycopg
except ImportError:  # Django on psycopg2
    psycopg = None

CONNECTION_LOST_STATES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "25P04"})
TIMEOUT_STATES = frozenset({"55P03", "57014"})

# The errors a lost session surfaces as (Django's, and psycopg's own below Django).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)
_DRIVER_ERRORS: tuple[type[BaseException], ...] = ()
if psycopg is not None:
    CONNECTION_ERRORS += (psycopg.OperationalError, psycopg.InterfaceError)
    _DRIVER_ERRORS += (psycopg.Error,)

# What the agent API's served statements raise to refuse a request (migration 0018).
REQUEST_REFUSED = "wd_request_refused"


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


_REFERENCE_CONSTRAINTS = {
    # (No key of its own for the community or the workflow: the run's key holds
    # both, migration 0009.)
    "wd_delivery_run_fk": "run (of that workflow)",
    "wd_delivery_message_event_fk": "message event (at that created_at)",
}
_LIFECYCLE_CONSTRAINTS = {"wd_community_lifecycle_forward", "wd_community_tombstone_permanent"}
_DELIVERY_PRIMARY_KEY = f"{WorkflowAgentDelivery._meta.db_table}_pkey"

_FENCED_COMMUNITY = re.compile(r"community_id=(\S+)")
_NOT_ENROLLED = re.compile(r"community_id=(\S+) unknown=(\S*) revoked=(\S*)")


def _not_enrolled(message: str, detail: str | None) -> TargetNotEnrolled:
    found = _NOT_ENROLLED.fullmatch(detail or "")
    if found is None:
        return TargetNotEnrolled(message)
    community, unknown, revoked = found.groups()
    return TargetNotEnrolled(
        message,
        UUID(community),
        tuple(unknown.split(",")) if unknown else (),
        tuple(revoked.split(",")) if revoked else (),
    )


def domain_error(exc: DatabaseError) -> Exception | None:
    """The named fact a Django database error ``exc`` stands for, or None when it is
    not ours to classify (a lost connection included)."""
    diag = getattr(exc.__cause__, "diag", None)
    constraint = getattr(diag, "constraint_name", None)
    state = sqlstate(exc)
    message = getattr(diag, "message_primary", None) or str(exc)
    if state in TIMEOUT_STATES:
        return DeliveryTimeout(f"{message} (SQLSTATE {state})", state)
    if constraint == "wd_community_write_fence":
        FENCE_REFUSALS.inc()
        found = _FENCED_COMMUNITY.search(getattr(diag, "message_detail", None) or "")
        return CommunityWriteFenced(message, UUID(found.group(1)) if found else None)
    if constraint == "wd_delivery_target_enrolled":
        return _not_enrolled(message, getattr(diag, "message_detail", None))
    if constraint == "wd_agent_community_fk":
        return CommunityNotFound(f"the roster's community does not exist: {message}")
    if constraint == "wd_delivery_one_message_per_step":
        return StepMessageConflict("message_event_id", message)
    if constraint in _LIFECYCLE_CONSTRAINTS:
        return InvalidLifecycleTransition(message)
    if constraint == _DELIVERY_PRIMARY_KEY:
        return DeliveryConflict(
            f"a delivery with this id already exists for another step or target: {message}"
        )
    if constraint in _REFERENCE_CONSTRAINTS:
        return ReferenceMissing(
            constraint,
            f"the {_REFERENCE_CONSTRAINTS[constraint]} named by the delivery does not exist "
            f"in its community ({constraint})",
        )
    if constraint and constraint.startswith("wd_"):
        return ConstraintViolation(constraint, f"{constraint}: {message}")
    if state == "25000" and "READ COMMITTED" in message:
        return IsolationLevelError(message)
    return None


def raise_domain_error(exc: BaseException) -> None:
    """Raise the named fact of a Django database error ``exc`` from it; return when
    there is none, so the caller re-raises ``exc``."""
    if isinstance(exc, DatabaseError):
        error = domain_error(exc)
        if error is not None:
            raise error from exc


@contextmanager
def database_errors() -> Iterator[None]:
    """Turn a Django database error raised inside the block into its named fact
    (``domain_error``); anything unrecognised is re-raised as it is."""
    try:
        yield
    except DatabaseError as exc:
        raise_domain_error(exc)
        raise
