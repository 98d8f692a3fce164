"""workflow_delivery/store/statements.sql is every final statement the store builds,
under its name, and a drift between the two fails with the command that rewrites it."""

from __future__ import annotations

import difflib

import pytest

from workflow_delivery.store import statements
from workflow_delivery.store.statements_sql import STATEMENTS_SQL, named_statements, statements_text


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
