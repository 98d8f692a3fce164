"""workflow_delivery/schema.sql is the schema the migrations build, and the comparison
sees every kind of object it lists."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from workflow_delivery.store.schema_sql import SCHEMA_SQL, schema_text

ROOT = Path(__file__).resolve().parents[2]


def _difference(expected: str, found: str) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            found.splitlines(keepends=True),
            fromfile="workflow_delivery/schema.sql",
            tofile="a freshly migrated database",
        )
    )


def test_schema_sql_is_what_the_migrations_build():
    # A database of its own, migrated from nothing: the test database of this run may
    # carry grants and roles other tests left.
    result = subprocess.run(
        [sys.executable, "-m", "workflow_delivery.store.schema_sql"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.support.settings"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    difference = _difference(SCHEMA_SQL.read_text(), result.stdout)
    if difference:
        pytest.fail(
            "workflow_delivery/schema.sql differs from the migrated schema; if the migration "
            "is right, run scripts/dump_schema and commit the file:\n" + difference,
            pytrace=False,
        )


def test_the_difference_reads_as_a_unified_diff():
    difference = _difference("a\nb\nc\n", "a\nB\nc\n")
    assert difference.splitlines() == [
        "--- workflow_delivery/schema.sql",
        "+++ a freshly migrated database",
        "@@ -1,3 +1,3 @@",
        " a",
        "-b",
        "+B",
        " c",
    ]


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        (
            "ALTER TABLE communities ADD COLUMN probe integer DEFAULT 7",
            "    probe integer DEFAULT 7",
        ),
        (
            "ALTER TABLE communities ADD CONSTRAINT wd_probe CHECK (host <> 'x')",
            "ALTER TABLE communities ADD CONSTRAINT wd_probe CHECK ((host <> 'x'::text));",
        ),
        (
            "CREATE INDEX wd_probe_idx ON communities (created_at)",
            "CREATE INDEX wd_probe_idx ON public.communities USING btree (created_at);",
        ),
        (
            "CREATE TRIGGER wd_probe AFTER DELETE ON communities "
            "FOR EACH STATEMENT EXECUTE FUNCTION wd_withdraw_executor_probe()",
            "CREATE TRIGGER wd_probe AFTER DELETE ON public.communities FOR EACH STATEMENT "
            "EXECUTE FUNCTION wd_withdraw_executor_probe();",
        ),
        ("GRANT SELECT ON communities TO PUBLIC", "GRANT SELECT ON communities TO PUBLIC;"),
        ("COMMENT ON TABLE events IS 'probe'", "COMMENT ON TABLE events IS 'probe';"),
    ],
    ids=["column", "constraint", "index", "trigger", "grant", "comment"],
)
def test_a_change_to_the_schema_shows_in_its_text(raw, change: str, shown: str):
    raw.execute(
        "CREATE FUNCTION wd_withdraw_executor_probe() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN RETURN NULL; END $$"
    )
    before = schema_text(connection)
    raw.execute(change)
    added = [
        line[1:]
        for line in _difference(before, schema_text(connection)).splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert shown in added, added


def test_a_changed_function_body_shows_in_its_text(raw):
    before = schema_text(connection)
    raw.execute(
        "CREATE OR REPLACE FUNCTION wd_community_deletion_key(p_community_id uuid) "
        "RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE "
        "AS $$ SELECT 42::bigint $$"
    )
    difference = _difference(before, schema_text(connection))
    assert "+AS $function$ SELECT 42::bigint $function$;" in difference.splitlines()


def test_the_text_holds_each_table_of_the_app_and_no_other(raw):
    from django.apps import apps

    text = schema_text(connection)
    for model in apps.get_app_config("workflow_delivery").get_models():
        assert f"TABLE {model._meta.db_table} (" in text
    assert "TABLE wd_executor_presentations (" in text
    assert "TABLE auth_user (" not in text
    assert "TABLE django_migrations (" not in text
