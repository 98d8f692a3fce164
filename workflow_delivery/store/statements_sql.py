"""The text of ``store/statements.sql``: every final statement, whole, under its name.

A reviewer reads the SQL the app runs top to bottom in one file (procrastinate's
``-- name: ... --`` style); fragments and builders stay in ``statements``. Names are
sorted; a dictionary or list of statements gives one entry per key or position.
``python -m workflow_delivery.store.statements_sql --write`` rewrites the file, and
``tests/store/test_statements_sql.py`` fails while the two disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

STATEMENTS_SQL = Path(__file__).resolve().parent / "statements.sql"
HEADER = (
    "-- Generated from workflow_delivery.store.statements by scripts/dump_statements;\n"
    "-- do not edit. Every final statement, under its name, in name order.\n"
)


def named_statements() -> list[tuple[str, str]]:
    """(name, text) of every public statement of ``statements``, in a stable order."""
    from . import statements
    from .statement import Statement

    found: list[tuple[str, str]] = []
    for name in sorted(n for n in vars(statements) if not n.startswith("_")):
        value = getattr(statements, name)
        if isinstance(value, Statement):
            found.append((name, value.text))
        elif (
            isinstance(value, dict)
            and value
            and all(isinstance(each, Statement) for each in value.values())
        ):
            found.extend((f"{name}[{key}]", value[key].text) for key in sorted(value))
        elif (
            isinstance(value, list | tuple)
            and value
            and all(isinstance(each, Statement) for each in value)
        ):
            found.extend((f"{name}[{index}]", each.text) for index, each in enumerate(value))
    return found


def statements_text() -> str:
    """The file's text: the header, then each statement under ``-- name: NAME --``."""
    parts = [HEADER]
    for name, text in named_statements():
        parts.append(f"\n-- name: {name} --\n{text.strip()};\n")
    return "".join(parts)


def main(argv: list[str]) -> None:
    import django
    from django.conf import settings

    # Quoting needs the PostgreSQL backend and the models, never a connection.
    if not settings.configured:
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.postgresql"}},
            INSTALLED_APPS=[
                "django.contrib.contenttypes",
                "django.contrib.auth",
                "workflow_delivery",
            ],
        )
    django.setup()
    text = statements_text()
    if "--write" in argv:
        STATEMENTS_SQL.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
