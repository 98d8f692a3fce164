"""A delivery's status changes are recorded once per statement, and its key is fixed.

Measured by ``bench/reap_rows.py`` (20,000 expired leases reaped flat out, one
process, median of 3): a reaped row cost 246 µs, 145 µs of it the timeline. Each row
called ``wd_record_delivery_transition()``, whose one-row INSERT was a statement of
its own and so also ran the timeline's statement fence trigger (0010) once per row.
With this migration a reaped row costs 146 µs, 35 µs of it the timeline; a batch
claim or finish of N rows writes its N entries in one INSERT as well.

* ``wd_delivery_timeline`` becomes an AFTER UPDATE statement trigger: one
  ``INSERT … SELECT`` writes an entry for every row whose status changed, with the
  same kind, actor, generation, attempts and statuses the row function chose (each
  still stamped by ``clock_timestamp()``). A session with
  ``workflow_delivery.timeline = off`` still records nothing; a renewal (status
  unchanged) still records nothing. The statement's community is already locked by
  the row fence before the insert asks for it again, so the timeline's own fence
  waits on nothing new. ``wd_record_delivery_transition()`` is dropped (0010 moved
  the INSERT trigger off it already).
* The statement trigger pairs old and new rows by ``id``, so a delivery's ``id`` and
  ``community_id`` can no longer change: ``wd_delivery_transition_guard`` refuses it
  (``wd_delivery_key_immutable``). Nothing in the app ever changed them; the id is the
  one the producer chose and every lease, wake-up and timeline entry names.

Reversing restores 0007's row trigger and function and 0004's guard.
"""

from django.db import migrations

TIMELINE = "workflow_delivery_timeline"

# 0007's row function, restored on reverse.
ROW_FUNCTION = """\
CREATE FUNCTION wd_record_delivery_transition() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_actor text := nullif(current_setting('workflow_delivery.actor', true), '');
    v_operator boolean;
    v_kind text;
BEGIN
    v_operator := coalesce(v_actor = 'operator' OR v_actor LIKE 'operator:%', false);
    IF TG_OP = 'INSERT' THEN
        v_kind := 'committed';
        v_actor := coalesce(v_actor, 'producer');
    ELSIF NEW.status = 'claimed' THEN
        v_kind := 'claimed';
        v_actor := coalesce(v_actor, 'holder');
    ELSIF NEW.status = 'pending' THEN
        -- Unnamed (a raw UPDATE): judged by the lease it took away.
        IF v_actor = 'reaper' OR (v_actor IS NULL AND OLD.lease_until < now()) THEN
            v_kind := 'reaped';
        ELSE
            v_kind := 'released';
        END IF;
        v_actor := coalesce(v_actor, 'sql');
    ELSIF NEW.status = 'failed' AND v_actor = 'reaper' THEN
        v_kind := 'attempts_exhausted';
    ELSIF NEW.status = 'failed' AND v_operator THEN
        v_kind := 'operator_failed';
    ELSE
        v_kind := NEW.status;
        v_actor := coalesce(v_actor, CASE WHEN OLD.status = 'claimed' THEN 'holder' ELSE 'sql' END);
    END IF;
    INSERT INTO workflow_delivery_timeline
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after, actor)
    VALUES (NEW.community_id, NEW.id, clock_timestamp(), v_kind, NEW.lease_generation, NEW.attempts,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.status END, NEW.status, v_actor);
    RETURN NULL;
END
$$;"""


STATEMENT_TIMELINE = rf"""
CREATE FUNCTION wd_record_deliveries_moved() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    -- 0007's row function, row by row: the kind and actor from the new status, the
    -- transaction's actor setting and, for an unnamed return to pending, the lease
    -- it took away.
    INSERT INTO {TIMELINE}
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after, actor)
    SELECT n.community_id, n.id, clock_timestamp(),
           CASE
               WHEN n.status = 'claimed' THEN 'claimed'
               WHEN n.status = 'pending' THEN
                   CASE WHEN w.actor = 'reaper' OR (w.actor IS NULL AND o.lease_until < now())
                        THEN 'reaped' ELSE 'released' END
               WHEN n.status = 'failed' AND w.actor = 'reaper' THEN 'attempts_exhausted'
               WHEN n.status = 'failed' AND w.operator THEN 'operator_failed'
               ELSE n.status
           END,
           n.lease_generation, n.attempts, o.status, n.status,
           coalesce(w.actor, CASE WHEN n.status = 'claimed' THEN 'holder'
                                  WHEN n.status = 'pending' THEN 'sql'
                                  WHEN o.status = 'claimed' THEN 'holder'
                                  ELSE 'sql' END)
      FROM moved_new AS n
      JOIN moved_old AS o ON o.id = n.id
     CROSS JOIN (
           SELECT a.actor, coalesce(a.actor = 'operator' OR a.actor LIKE 'operator:%', false)
                  AS operator
             FROM (SELECT nullif(current_setting('workflow_delivery.actor', true), '') AS actor) AS a
     ) AS w
     WHERE n.status IS DISTINCT FROM o.status;
    RETURN NULL;
END
$$;

DROP TRIGGER wd_delivery_timeline ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_timeline
    AFTER UPDATE ON workflow_agent_deliveries
    REFERENCING OLD TABLE AS moved_old NEW TABLE AS moved_new
    FOR EACH STATEMENT EXECUTE FUNCTION wd_record_deliveries_moved();
DROP FUNCTION wd_record_delivery_transition();
"""

REVERSE_STATEMENT_TIMELINE = f"""
{ROW_FUNCTION}

DROP TRIGGER wd_delivery_timeline ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_timeline
    AFTER UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.status IS DISTINCT FROM OLD.status
        AND current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
    )
    EXECUTE FUNCTION wd_record_delivery_transition();
DROP FUNCTION wd_record_deliveries_moved();
"""

GUARD = r"""
CREATE OR REPLACE FUNCTION wd_reject_delivery_transition() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF NEW.lease_generation < OLD.lease_generation THEN
        RAISE EXCEPTION 'delivery %: lease_generation cannot decrease (% -> %)',
            OLD.id, OLD.lease_generation, NEW.lease_generation
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_lease_generation_monotonic', TABLE = TG_TABLE_NAME;
    END IF;
    IF (NEW.id, NEW.community_id) IS DISTINCT FROM (OLD.id, OLD.community_id) THEN
        RAISE EXCEPTION 'delivery % of community %: its id and community cannot change (to % of %)',
            OLD.id, OLD.community_id, NEW.id, NEW.community_id
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_key_immutable', TABLE = TG_TABLE_NAME;
    END IF;
    RAISE EXCEPTION 'delivery % is already %: a terminal outcome cannot change', OLD.id, OLD.status
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_delivery_terminal_once', TABLE = TG_TABLE_NAME;
END
$$;

DROP TRIGGER wd_delivery_transition_guard ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_transition_guard
    AFTER UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.lease_generation < OLD.lease_generation
        OR (NEW.id, NEW.community_id) IS DISTINCT FROM (OLD.id, OLD.community_id)
        OR (
            OLD.status IN ('finished', 'failed')
            AND (NEW.status, NEW.finished_at) IS DISTINCT FROM (OLD.status, OLD.finished_at)
        )
    )
    EXECUTE FUNCTION wd_reject_delivery_transition();
"""

# 0004's guard, restored on reverse.
REVERSE_GUARD = """
DROP TRIGGER wd_delivery_transition_guard ON workflow_agent_deliveries;
DROP FUNCTION wd_reject_delivery_transition();

CREATE FUNCTION wd_reject_delivery_transition() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF NEW.lease_generation < OLD.lease_generation THEN
        RAISE EXCEPTION 'delivery %: lease_generation cannot decrease (% -> %)',
            OLD.id, OLD.lease_generation, NEW.lease_generation
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_lease_generation_monotonic', TABLE = TG_TABLE_NAME;
    END IF;
    RAISE EXCEPTION 'delivery % is already %: a terminal outcome cannot change', OLD.id, OLD.status
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_delivery_terminal_once', TABLE = TG_TABLE_NAME;
END
$$;

CREATE TRIGGER wd_delivery_transition_guard
    AFTER UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.lease_generation < OLD.lease_generation
        OR (
            OLD.status IN ('finished', 'failed')
            AND (NEW.status, NEW.finished_at) IS DISTINCT FROM (OLD.status, OLD.finished_at)
        )
    )
    EXECUTE FUNCTION wd_reject_delivery_transition();

"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0010_statement_level_inserts")]

    operations = [
        migrations.RunSQL(sql=GUARD, reverse_sql=REVERSE_GUARD),
        migrations.RunSQL(sql=STATEMENT_TIMELINE, reverse_sql=REVERSE_STATEMENT_TIMELINE),
    ]
