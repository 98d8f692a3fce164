"""The sessions on the test database's server: which the server sees besides the test's own,
the backend of the calling thread, and ending one from a second connection."""

from __future__ import annotations

from django.db import connection


def other_sessions() -> int:
    """Sessions open on the test database other than the test's own connection."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def listening_sessions() -> int:
    """``wakeups.WakeListener`` sessions open on the test database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() "
            "AND application_name = 'workflow_delivery wake listener'"
        )
        return cursor.fetchone()[0]


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def terminate(pid: int) -> None:
    """End a backend from a second connection, opened and closed here."""
    other = connection.get_new_connection(connection.get_connection_params())
    try:
        other.autocommit = True
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cursor.fetchone()[0] is True
    finally:
        other.close()
