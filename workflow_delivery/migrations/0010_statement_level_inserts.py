"""A producer's step pays the fence and the timeline once per statement, not per row.

Measured by ``bench/row_rules.py`` (100-target steps, one process): of 124 µs a row,
the timeline's "committed" row took 43 µs (a PL/pgSQL call and a one-row INSERT per
delivery, each of which ran the timeline's own fence trigger) and the delivery's fence
trigger 14 µs (a PL/pgSQL call, the shared lock and a lookup of the community).

* ``wd_delivery_timeline_commit`` becomes a statement trigger: one
  ``INSERT … SELECT`` from the statement's new rows (a transition table) writes every
  "committed" entry, each still stamped by ``clock_timestamp()`` and naming the actor
  as before; a session with ``workflow_delivery.timeline = off`` still records nothing.
* On ``workflow_agent_deliveries`` and ``workflow_delivery_timeline`` the fence's
  INSERT check moves to ``wd_community_write_fence_insert``, an AFTER INSERT statement
  trigger that runs 0006's check (``wd_require_community_write``, the row function's
  check as a function of its own) once for each community among the statement's new
  rows. ``wd_community_write_fence`` keeps guarding UPDATE and DELETE row by row. The
  check still comes before the commit and holds the shared lock until it, so the
  deletion executor's exclusive lock still waits for every writer that passed, and a
  statement refused by it writes nothing.
  What changes: an INSERT that creates no row (every row skipped by ``ON CONFLICT DO
  NOTHING``) writes nothing and is no longer refused, and another error of the same
  statement (a duplicate key, a foreign key) is reported before the fence's. The
  service's producers ask the same function themselves in the inserting statement,
  right after the step's identity lock, so a commit or a retry into a community that
  is not active is still refused.

The other tenant tables (workflows, runs, events) keep the row trigger for every
write, and ``wd_delivery_one_message_per_step`` stays a row trigger. Reversing
restores 0007's row triggers.
"""

from django.db import migrations

TIMELINE = "workflow_delivery_timeline"

TABLES = ["workflow_agent_deliveries", "workflow_delivery_timeline"]


STATEMENT_FENCE = r"""
-- 0006's fence check of one community as a function (the row trigger keeps its own
-- copy, to spare every claim and finish a call): raises the fence's error unless a
-- write of p_operation on p_table may go to the community (it is active, or this
-- transaction is its deletion executor, proven by the exclusive lock); takes the
-- shared deletion lock for the rest of the transaction.
CREATE FUNCTION wd_require_community_write(
    p_community_id uuid, p_operation text, p_table text, p_schema text
) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_host text;
    v_state text;
    v_generation bigint;
BEGIN
    IF p_community_id IS NULL THEN
        RETURN;
    END IF;
    PERFORM wd_require_read_committed();
    PERFORM pg_advisory_xact_lock_shared(wd_community_deletion_key(p_community_id));
    SELECT host, deletion_state, deletion_fence_generation
      INTO v_host, v_state, v_generation
      FROM communities WHERE id = p_community_id;
    IF NOT FOUND OR v_state = 'active' THEN
        RETURN;
    END IF;
    IF current_setting('workflow_delivery.executor_community', true)
           IS NOT DISTINCT FROM p_community_id::text
       AND current_setting('workflow_delivery.executor_generation', true)
           IS NOT DISTINCT FROM v_generation::text
       AND wd_holds_community_deletion_lock(p_community_id) THEN
        RETURN;
    END IF;
    RAISE EXCEPTION 'community % (%) is %: % on % refused by the community write fence',
        p_community_id, v_host, v_state, p_operation, p_table
        USING ERRCODE = 'object_not_in_prerequisite_state',
              CONSTRAINT = 'wd_community_write_fence',
              TABLE = p_table,
              SCHEMA = p_schema,
              DETAIL = format('community_id=%s deletion_state=%s', p_community_id, v_state);
END
$$;

CREATE FUNCTION wd_enforce_community_write_fence_on_insert() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_id uuid;
BEGIN
    FOR v_id IN SELECT DISTINCT community_id FROM written WHERE community_id IS NOT NULL LOOP
        PERFORM wd_require_community_write(v_id, TG_OP, TG_TABLE_NAME, TG_TABLE_SCHEMA);
    END LOOP;
    RETURN NULL;
END
$$;
"""

REVERSE_STATEMENT_FENCE = """
DROP FUNCTION wd_enforce_community_write_fence_on_insert();
DROP FUNCTION wd_require_community_write(uuid, text, text, text);
"""


def _split_fence(table: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"""
DROP TRIGGER wd_community_write_fence ON {table};
CREATE TRIGGER wd_community_write_fence BEFORE UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();
CREATE TRIGGER wd_community_write_fence_insert AFTER INSERT ON {table}
    REFERENCING NEW TABLE AS written
    FOR EACH STATEMENT EXECUTE FUNCTION wd_enforce_community_write_fence_on_insert();
""",
        reverse_sql=f"""
DROP TRIGGER wd_community_write_fence_insert ON {table};
DROP TRIGGER wd_community_write_fence ON {table};
CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();
""",
    )


COMMITTED_ENTRIES = rf"""
CREATE FUNCTION wd_record_deliveries_committed() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    INSERT INTO {TIMELINE}
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after, actor)
    SELECT d.community_id, d.id, clock_timestamp(), 'committed', d.lease_generation, d.attempts,
           NULL, d.status,
           coalesce(nullif(current_setting('workflow_delivery.actor', true), ''), 'producer')
      FROM created AS d;
    RETURN NULL;
END
$$;

DROP TRIGGER wd_delivery_timeline_commit ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_timeline_commit
    AFTER INSERT ON workflow_agent_deliveries
    REFERENCING NEW TABLE AS created
    FOR EACH STATEMENT EXECUTE FUNCTION wd_record_deliveries_committed();
"""

REVERSE_COMMITTED_ENTRIES = """
DROP TRIGGER wd_delivery_timeline_commit ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_timeline_commit
    AFTER INSERT ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off')
    EXECUTE FUNCTION wd_record_delivery_transition();
DROP FUNCTION wd_record_deliveries_committed();
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0009_leaner_delivery_indexes")]

    operations = [
        migrations.RunSQL(sql=STATEMENT_FENCE, reverse_sql=REVERSE_STATEMENT_FENCE),
        *[_split_fence(table) for table in TABLES],
        migrations.RunSQL(sql=COMMITTED_ENTRIES, reverse_sql=REVERSE_COMMITTED_ENTRIES),
    ]
