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
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.exit(
            f"database error: {reason}\n"
            "Check that PostgreSQL is running and that DATABASE_URL points at it "
            "(unset DATABASE_URL to use the embedded server)."
        )


if __name__ == "__main__":
    main()
