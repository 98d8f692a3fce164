"""A second session outside Django (psycopg 3), for the tests that hold a lock or a
transaction open while the app acts. A test module that imports this one is left out of
the psycopg2 cell (noxfile.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from django.db import connection

from tests.support.locks import LOCK_TIMEOUT


def dsn() -> str:
    settings = connection.settings_dict
    parts = {
        "dbname": settings["NAME"],
        "host": settings["HOST"] or "",
        "port": str(settings["PORT"] or ""),
        "user": settings["USER"] or "",
        "password": settings["PASSWORD"] or "",
    }
    return " ".join(f"{key}='{value}'" for key, value in parts.items() if value)


@contextmanager
def other() -> Iterator[psycopg.Connection]:
    """A second session, outside Django, in an explicit transaction."""
    conn = psycopg.connect(dsn())
    conn.execute("SELECT set_config('lock_timeout', %s, false)", [LOCK_TIMEOUT])
    conn.commit()
    try:
        yield conn
    finally:
        conn.close()


def backend_pid(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]
