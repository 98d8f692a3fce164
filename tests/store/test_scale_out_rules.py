"""The rules docs/explanation/scale-out.md relies on to distribute the schema by
``community_id`` (Citus), checked against the migrated test database's catalog: the tables
that carry ``community_id`` are the ones the page names as distributed, every foreign key
between them includes ``community_id`` on both sides (a co-located join), and each has a
unique key led by ``community_id`` that can become its primary key."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

# As docs/explanation/scale-out.md lists them.
DISTRIBUTED = {
    "agent_request_replays",
    "community_agents",
    "events",
    "workflow_agent_deliveries",
    "workflow_delivery_agent_turns",
    "workflow_delivery_idle_wake_targets",
    "workflow_delivery_timeline",
    "workflow_runs",
    "workflows",
}
REFERENCE = {"communities"}
# Distributed tables with no unique key led by community_id yet: the plan's first step
# gives each one, (community_id, id), before any primary key changes.
NEEDS_TENANT_KEY = {"agent_request_replays", "workflow_delivery_timeline"}
LOCAL = {"wd_executor_presentations"}

APP_TABLES = """
SELECT c.relname, EXISTS (
         SELECT FROM pg_attribute a
          WHERE a.attrelid = c.oid AND a.attname = 'community_id' AND NOT a.attisdropped)
  FROM pg_class c
 WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p')
   AND (c.relname = ANY(%s) OR c.relname LIKE 'wd\\_%%')
"""

FOREIGN_KEYS = """
SELECT con.conname, src.relname, dst.relname,
       ARRAY(SELECT a.attname FROM unnest(con.conkey) WITH ORDINALITY k(n, i)
               JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
              ORDER BY k.i),
       ARRAY(SELECT a.attname FROM unnest(con.confkey) WITH ORDINALITY k(n, i)
               JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n
              ORDER BY k.i)
  FROM pg_constraint con
  JOIN pg_class src ON src.oid = con.conrelid
  JOIN pg_class dst ON dst.oid = con.confrelid
 WHERE con.contype = 'f' AND src.relname = ANY(%s)
"""

UNIQUE_KEYS = """
SELECT src.relname,
       ARRAY(SELECT a.attname FROM unnest(con.conkey) WITH ORDINALITY k(n, i)
               JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
              ORDER BY k.i)
  FROM pg_constraint con
  JOIN pg_class src ON src.oid = con.conrelid
 WHERE con.contype IN ('p', 'u') AND src.relname = ANY(%s)
"""


def _rows(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def test_the_tables_with_community_id_are_the_ones_the_plan_distributes():
    names = sorted(DISTRIBUTED | REFERENCE | LOCAL)
    tables = dict(_rows(APP_TABLES, [names]))
    assert {name for name, tenant in tables.items() if tenant} == DISTRIBUTED
    assert {name for name, tenant in tables.items() if not tenant} == REFERENCE | LOCAL


def test_every_foreign_key_between_distributed_tables_includes_community_id():
    keys = _rows(FOREIGN_KEYS, [sorted(DISTRIBUTED)])
    assert keys
    for name, _source, target, columns, referenced in keys:
        if target in REFERENCE:
            # To a reference table: Citus needs no distribution column here.
            continue
        assert target in DISTRIBUTED, (name, target)
        assert "community_id" in columns, name
        position = columns.index("community_id")
        assert referenced[position] == "community_id", name


def test_the_tables_lacking_a_unique_key_led_by_community_id_are_the_plans_first_step():
    keys: dict[str, list[list[str]]] = {}
    for table, columns in _rows(UNIQUE_KEYS, [sorted(DISTRIBUTED)]):
        keys.setdefault(table, []).append(columns)
    lacking = {
        table
        for table in DISTRIBUTED
        if not any(columns[0] == "community_id" for columns in keys.get(table, []))
    }
    assert lacking == NEEDS_TENANT_KEY
    # Every other primary key today is the single column id: what the plan must widen.
    single = {table for table, found in keys.items() if ["id"] in found}
    assert single == DISTRIBUTED - {"workflow_delivery_idle_wake_targets"}
