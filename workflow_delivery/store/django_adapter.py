"""Every undocumented part of Django's database connection the app touches, in one place.

Django documents ``connections``, ``transaction`` and ``execute_wrapper()``; the store
runs its statements below Django's cursor, so it also needs what Django's own
``cursor()`` does before handing a cursor out, and a few facts about the connection.
Each is read here and nowhere else. Read against the source of Django 5.2
(``django/db/backends/base/base.py``: ``BaseDatabaseWrapper``); Django 6.0 and 6.1, the
compatibility matrix's other versions, are held to it by ``tests/test_django_adapter.py``,
which checks on the installed Django, in each nox cell, that every attribute is there
and behaves as this module assumes.

``ATTRIBUTES`` names them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# What this module reads or calls on a ``BaseDatabaseWrapper``, none of it documented.
ATTRIBUTES = (
    "connection",  # the driver's connection, None while closed
    "ensure_connection",  # opens a closed connection; refused inside an event loop
    "health_check_enabled",  # CONN_HEALTH_CHECKS
    "health_check_done",  # the per-request health check already made
    "close_if_health_check_failed",
    "in_atomic_block",  # inside transaction.atomic()
    "validate_thread_sharing",  # raises DatabaseError on another thread's connection
    "allow_thread_sharing",  # inc_thread_sharing() in effect
    "validate_no_broken_transaction",  # raises TransactionManagementError after an error
    "wrap_database_errors",  # the driver's errors made Django's
    "execute_wrappers",  # the list execute_wrapper() pushes to and pops from
)


def raw(wrapper: Any) -> Any:
    """The driver's connection under ``wrapper``, or None while it is closed."""
    return wrapper.connection


def connect(wrapper: Any) -> Any:
    """The checks Django's ``cursor()`` makes before it hands a cursor out: the
    per-request health check (``CONN_HEALTH_CHECKS``), then a connection opened if
    there is none (refused inside an event loop or an atomic block whose connection
    was closed). Answers the driver's connection."""
    if wrapper.health_check_enabled and not wrapper.health_check_done:
        wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    return wrapper.connection


def pooled(wrapper: Any) -> bool:
    """True when Django's connection pool (``OPTIONS={"pool": ...}``, psycopg 3) owns
    the wrapper's connections: read from the documented settings, not the wrapper."""
    return bool(wrapper.settings_dict.get("OPTIONS", {}).get("pool"))


def health_check_pending(wrapper: Any) -> bool:
    """True when the per-request health check is on and not yet made."""
    return wrapper.health_check_enabled and not wrapper.health_check_done


def health_check_made(wrapper: Any) -> None:
    """Record the per-request health check as made (by the caller, its own way)."""
    wrapper.health_check_done = True


def in_transaction(wrapper: Any) -> bool:
    """True inside ``transaction.atomic()``."""
    return wrapper.in_atomic_block


def shared_between_threads(wrapper: Any) -> bool:
    """True while ``inc_thread_sharing()`` lets other threads use the connection."""
    return wrapper.allow_thread_sharing


def check_thread(wrapper: Any) -> None:
    """Refuse (``DatabaseError``) a connection of another thread, as Django's cursor does."""
    wrapper.validate_thread_sharing()


def check_statement(wrapper: Any) -> None:
    """What Django's cursor checks before each statement: this thread may use the
    connection, and the caller's transaction is not already broken
    (``TransactionManagementError``)."""
    wrapper.validate_thread_sharing()
    wrapper.validate_no_broken_transaction()


def as_django_errors(wrapper: Any) -> Any:
    """The context manager that raises the driver's errors as Django's (and marks the
    connection for Django's end-of-request check), as Django's cursor does."""
    return wrapper.wrap_database_errors


def keep_execute_wrapper(wrapper: Any, function: Callable[..., Any]) -> None:
    """Install ``function`` as an execute wrapper of ``wrapper`` for good (once), first
    of the wrappers, since ``execute_wrapper()`` blocks pop the last."""
    installed = wrapper.execute_wrappers
    if function not in installed:
        installed.insert(0, function)
