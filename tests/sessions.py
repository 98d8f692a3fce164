"""What the test database's server sees of sessions besides the test's own."""

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
