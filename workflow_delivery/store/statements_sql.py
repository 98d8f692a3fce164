"""The text of ``store/statements.sql``: every final statement, whole, under its name.

A reviewer reads the SQL the app runs top to bottom in one file (procrastinate's
``-- name: ... --`` style); fragments and builders stay in the ``statements`` package.
Every module of the package is read, and the statements of all of them are written in
one name order; a dictionary or list of statements gives one entry per key or position.
``python -m workflow_delivery.store.statements_sql --write`` rewrites the file, and
``tests/store/test_statements_sql.py`` fails while the two disagree.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

STATEMENTS_SQL = Path(__file__).resolve().parent / "statements.sql"
HEADER = (
    "-- Generated from workflow_delivery.store.statements by scripts/dump_statements;\n"
    "-- do not edit. Every final statement, under its name, in name order.\n"
)


def statement_modules() -> list[ModuleType]:
    """Every module of the ``statements`` package, in name order."""
    from . import statements

    return [
        importlib.import_module(f"{statements.__name__}.{module.name}")
        for module in sorted(pkgutil.iter_modules(statements.__path__), key=lambda m: m.name)
    ]


def _entries(name: str, value: object) -> list[tuple[str, str]]:
    """(name, text) of a statement, or of each in a dictionary (by key) or a list (by
    position) of statements; nothing for any other value."""
    from .statement import Statement

    if isinstance(value, Statement):
        return [(name, value.text)]
    if isinstance(value, dict) and value and all(isinstance(v, Statement) for v in value.values()):
        return [(f"{name}[{key}]", value[key].text) for key in sorted(value)]
    if isinstance(value, list | tuple) and value and all(isinstance(v, Statement) for v in value):
        return [(f"{name}[{index}]", each.text) for index, each in enumerate(value)]
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], Statement) for v in value)
    ):
        # (key, statement) pairs, in their order: PURGE's, by table.
        return [(f"{name}[{key}]", each.text) for key, each in value]
    return []


# What the builders make on demand, for the arguments shown: each insert a producer
# may wrap in its wake-ups, and the reaper's batch at the default size, with the
# default attempts cap and without one.
NOTIFYING = (
    "INSERT_DELIVERIES",
    "INSERT_SHARED_DELIVERIES",
    "LOCK_AND_INSERT_DELIVERIES",
    "LOCK_AND_INSERT_SHARED_DELIVERIES",
)
REAP_BATCH = ((500, 20), (500, None))


def built_statements() -> dict[str, list[tuple[str, str]]]:
    """The builders' statements (``NOTIFYING``, ``REAP_BATCH``), by builder."""
    from . import statements

    return {
        "notifying": [
            (f"notifying({name})", statements.notifying(getattr(statements, name)).text)
            for name in NOTIFYING
        ],
        "reap_batch": [
            (f"reap_batch({size}, {cap})", statements.reap_batch(size, cap).text)
            for size, cap in REAP_BATCH
        ],
    }


def named_statements() -> list[tuple[str, str]]:
    """(name, text) of every public statement of every module of ``statements`` and of
    its builders (``built_statements``), in a stable order: by name, then a
    dictionary's by key and a list's by position. A name two modules share (one
    imports the other's) must be the same statement."""
    by_name = built_statements()
    for module in statement_modules():
        for name, value in vars(module).items():
            entries = _entries(name, value) if not name.startswith("_") else []
            if not entries:
                continue
            if by_name.setdefault(name, entries) != entries:
                raise ValueError(f"two modules of statements name different statements {name}")
    return [entry for name in sorted(by_name) for entry in by_name[name]]


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
