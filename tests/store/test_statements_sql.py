"""workflow_delivery/store/statements.sql is every final statement the store builds,
under its name, and a drift between the two fails with the command that rewrites it."""

from __future__ import annotations

import difflib
import re

import pytest

from workflow_delivery.store import statements
from workflow_delivery.store.statements_sql import (
    STATEMENTS_SQL,
    named_statements,
    statement_modules,
    statements_text,
)


def test_statements_sql_is_what_the_store_builds():
    difference = "".join(
        difflib.unified_diff(
            STATEMENTS_SQL.read_text().splitlines(keepends=True),
            statements_text().splitlines(keepends=True),
            fromfile="workflow_delivery/store/statements.sql",
            tofile="workflow_delivery.store.statements",
        )
    )
    if difference:
        pytest.fail(
            "workflow_delivery/store/statements.sql differs from the statements the store "
            "builds; run scripts/dump_statements and commit the file:\n" + difference,
            pytrace=False,
        )


def test_every_statement_is_named_once_and_its_text_is_whole():
    named = dict(named_statements())
    assert len(named) == len(named_statements())
    assert named["CLAIM"] == statements.CLAIM.text
    assert named["SERVED_CLAIM"] == statements.SERVED_CLAIM.text
    for cause, statement in statements.CLAIM_EXPECTED.items():
        assert named[f"CLAIM_EXPECTED[{cause}]"] == statement.text
    assert f"-- name: FINISH --\n{statements.FINISH.text.strip()};\n" in statements_text()
    # What the builders make, for the arguments the file shows.
    assert named["reap_batch(500, 20)"] == statements.reap_batch(500, 20).text
    assert named["notifying(INSERT_DELIVERIES)"] == (
        statements.notifying(statements.INSERT_DELIVERIES).text
    )
    for table, statement in statements.PURGE:
        assert named[f"PURGE[{table}]"] == statement.text


def test_every_module_of_the_package_is_read_and_each_statement_is_named_by_the_package():
    modules = {module.__name__.rsplit(".", 1)[1] for module in statement_modules()}
    assert {"producer", "holder", "maintenance", "roster", "fence", "api", "reads"} <= modules
    named = {re.split(r"[\[(]", name, maxsplit=1)[0] for name, _ in named_statements()}
    # Callers write statements.NAME: the package names each statement of its modules.
    assert sorted(name for name in named if not hasattr(statements, name)) == []
    for module in statement_modules():
        for name in named & set(vars(module)):
            assert getattr(statements, name) is vars(module)[name], f"{module.__name__}.{name}"
