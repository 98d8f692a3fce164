#!/usr/bin/env python
"""Django's command-line utility for the buzz project."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "buzz_project.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import OperationalError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        sys.exit(f"configuration error: {exc}")
    except OperationalError as exc:
        # A server that answered with an error (its own SQLSTATE, not a connection
        # failure) is a real failure of the command: keep its traceback.
        # psycopg 3 names the SQLSTATE ``sqlstate``, psycopg2 ``pgcode``.
        sqlstate = getattr(exc.__cause__, "sqlstate", None) or getattr(
            exc.__cause__, "pgcode", None
        )
        if sqlstate and not sqlstate.startswith(("08", "3D", "28", "57P")):
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.exit(
            f"database error: cannot use the database: {reason}\n"
            "Check that PostgreSQL is running and that DATABASE_URL points at it "
            "(unset DATABASE_URL to use the embedded server)."
        )


if __name__ == "__main__":
    main()
