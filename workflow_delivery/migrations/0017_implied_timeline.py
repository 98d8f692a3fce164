"""The timeline stores only what a delivery's own row cannot say.

A delivery's usual life (committed, claimed, settled by its holder) is written in the
row itself: ``created_at``, the claim's time, ``finished_at``, ``attempts`` and
``lease_generation``. The timeline table keeps every other entry, and
``workflow_delivery.history`` merges the two into the history the admin shows.

* ``last_claimed_at``: when the delivery was last claimed. ``claimed_at`` is the live
  lease's and goes with it; this one stays. The database keeps it:
  ``wd_count_delivery_attempts()``, which counts each claim, sets it to the claim's
  ``claimed_at``, and refuses any other change of it or a new row that has one
  (``wd_delivery_last_claimed_at_by_claims``). Claimed rows start with their
  ``claimed_at``; earlier claims of other rows are in their stored entries already.
* ``wd_delivery_timeline`` and ``wd_delivery_timeline_commit`` become row triggers
  whose WHEN clause passes over the usual life without calling anything: a commit
  of a pending row at generation 0, a claim from pending, and a holder's settle at its
  lease's generation that records no error, all without the transaction's
  ``workflow_delivery.actor`` set. Everything else calls
  ``wd_record_delivery_departure()``, which writes the entry with the kind, actor,
  generation, attempts, statuses and error 0014 chose; and when the row leaves a
  claim that no entry records yet, the entry of that claim first (from the old row:
  its time, generation and attempts), so the stored entries stay in order. A claimed
  row whose generation changes without a status change records its claim the same
  way. ``workflow_delivery.timeline = off`` still records nothing.

Functions name their tables with the schema the app is migrated into and pin
``search_path``. Reversing restores 0014's statement triggers and functions (the
entries implied meanwhile are not written back) and drops the column.
"""

from django.db import migrations, models

FORWARD = r"""
UPDATE {schema}.workflow_agent_deliveries SET last_claimed_at = claimed_at
 WHERE status = 'claimed';

CREATE OR REPLACE FUNCTION {schema}.wd_count_delivery_attempts() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.attempts > 0 THEN
            RAISE EXCEPTION 'delivery %: a new delivery has no attempts (attempts = %)',
                NEW.id, NEW.attempts
                USING ERRCODE = 'check_violation',
                      CONSTRAINT = 'wd_delivery_attempts_count_claims', TABLE = TG_TABLE_NAME;
        END IF;
        RAISE EXCEPTION 'delivery %: a new delivery was never claimed (last_claimed_at = %)',
            NEW.id, NEW.last_claimed_at
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_last_claimed_at_by_claims', TABLE = TG_TABLE_NAME;
    END IF;
    IF OLD.status = 'pending' AND NEW.status = 'claimed' THEN
        NEW.attempts := OLD.attempts + 1;
        NEW.last_claimed_at := NEW.claimed_at;
        RETURN NEW;
    END IF;
    IF NEW.attempts IS DISTINCT FROM OLD.attempts THEN
        RAISE EXCEPTION 'delivery %: attempts counts claims and changes only by one (% -> %)',
            OLD.id, OLD.attempts, NEW.attempts
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_attempts_count_claims', TABLE = TG_TABLE_NAME;
    END IF;
    RAISE EXCEPTION 'delivery %: last_claimed_at is the time of its last claim and changes only with a claim (% -> %)',
        OLD.id, OLD.last_claimed_at, NEW.last_claimed_at
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_delivery_last_claimed_at_by_claims', TABLE = TG_TABLE_NAME;
END
$$;

DROP TRIGGER wd_delivery_attempts ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_attempts
    BEFORE UPDATE ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        (OLD.status = 'pending' AND NEW.status = 'claimed')
        OR (NEW.attempts IS DISTINCT FROM OLD.attempts AND NEW.attempts >= 0)
        OR NEW.last_claimed_at IS DISTINCT FROM OLD.last_claimed_at
    )
    EXECUTE FUNCTION {schema}.wd_count_delivery_attempts();

DROP TRIGGER wd_delivery_attempts_start ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_attempts_start
    BEFORE INSERT ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (NEW.attempts > 0 OR NEW.last_claimed_at IS NOT NULL)
    EXECUTE FUNCTION {schema}.wd_count_delivery_attempts();

CREATE FUNCTION {schema}.wd_record_delivery_departure() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
DECLARE
    v_actor text := nullif(current_setting('workflow_delivery.actor', true), '');
    v_operator boolean;
    v_recorded boolean;
    v_claim boolean;
    v_kind text;
    v_carries boolean;
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {schema}.workflow_delivery_timeline
            (community_id, delivery_id, at, kind, generation, attempts, status_before,
             status_after, actor)
        VALUES (NEW.community_id, NEW.id, clock_timestamp(), 'committed', NEW.lease_generation,
                NEW.attempts, NULL, NEW.status, coalesce(v_actor, 'producer'));
        RETURN NULL;
    END IF;
    v_operator := coalesce(v_actor = 'operator' OR v_actor LIKE 'operator:%', false);
    v_recorded := NEW.last_error_type IS NOT NULL
                  AND NEW.last_error_at IS DISTINCT FROM OLD.last_error_at;
    -- The claim this change ends was implied by the row until now: it is written
    -- first, as it was, unless an entry (a claim with an actor, a claimed commit)
    -- records it already.
    v_claim := OLD.status = 'claimed' AND NOT EXISTS (
        SELECT 1 FROM {schema}.workflow_delivery_timeline AS t
         WHERE t.community_id = OLD.community_id AND t.delivery_id = OLD.id
           AND t.status_after = 'claimed' AND t.attempts = OLD.attempts
    );
    IF NEW.status IS NOT DISTINCT FROM OLD.status THEN
        v_kind := NULL;
    ELSIF NEW.status = 'claimed' THEN
        v_kind := 'claimed';
    ELSIF NEW.status = 'pending' AND v_recorded THEN
        v_kind := 'retried';
    ELSIF NEW.status = 'pending' THEN
        -- Unnamed (a raw UPDATE): judged by the lease it took away.
        IF v_actor = 'reaper' OR (v_actor IS NULL AND OLD.lease_until < now()) THEN
            v_kind := 'reaped';
        ELSE
            v_kind := 'released';
        END IF;
    ELSIF NEW.status = 'failed' AND v_actor = 'reaper' THEN
        v_kind := 'attempts_exhausted';
    ELSIF NEW.status = 'failed' AND v_operator THEN
        v_kind := 'operator_failed';
    ELSIF NEW.status = 'failed' AND v_recorded AND NEW.lease_generation > OLD.lease_generation THEN
        v_kind := 'attempts_exhausted';
    ELSE
        v_kind := NEW.status;
    END IF;
    v_carries := v_recorded AND v_kind IN ('retried', 'failed', 'attempts_exhausted');
    INSERT INTO {schema}.workflow_delivery_timeline
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after,
         actor, error_type, error_message, error_traceback)
    SELECT v.community_id, v.delivery_id, v.at, v.kind, v.generation, v.attempts,
           v.status_before, v.status_after, v.actor, v.error_type, v.error_message,
           v.error_traceback
      FROM (
        VALUES
        (1, v_claim, OLD.community_id, OLD.id, coalesce(OLD.last_claimed_at, OLD.claimed_at),
         'claimed', OLD.lease_generation, OLD.attempts, 'pending', 'claimed', 'holder',
         NULL::text, NULL::text, NULL::text),
        (2, v_kind IS NOT NULL, NEW.community_id, NEW.id, clock_timestamp(), v_kind,
         NEW.lease_generation, NEW.attempts, OLD.status, NEW.status,
         coalesce(v_actor, CASE WHEN NEW.status = 'claimed' THEN 'holder'
                                WHEN NEW.status = 'pending' AND v_recorded THEN 'holder'
                                WHEN NEW.status = 'pending' THEN 'sql'
                                WHEN OLD.status = 'claimed' THEN 'holder'
                                ELSE 'sql' END),
         CASE WHEN v_carries THEN NEW.last_error_type END,
         CASE WHEN v_carries THEN NEW.last_error_message END,
         CASE WHEN v_carries
              THEN nullif(current_setting('workflow_delivery.error_traceback', true), '') END)
    ) AS v (n, wanted, community_id, delivery_id, at, kind, generation, attempts, status_before,
            status_after, actor, error_type, error_message, error_traceback)
     WHERE v.wanted
     ORDER BY v.n;
    RETURN NULL;
END
$$;

DROP TRIGGER wd_delivery_timeline ON {schema}.workflow_agent_deliveries;
DROP TRIGGER wd_delivery_timeline_commit ON {schema}.workflow_agent_deliveries;
DROP FUNCTION {schema}.wd_record_deliveries_moved();
DROP FUNCTION {schema}.wd_record_deliveries_committed();

-- The usual life never enters the function: a pending commit at generation 0, a
-- claim, and the holder's own settle at its generation with no error recorded, none
-- of them under a named actor. A renewal changes no status and is not recorded.
CREATE TRIGGER wd_delivery_timeline
    AFTER UPDATE ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        (NEW.status IS DISTINCT FROM OLD.status
         OR (OLD.status = 'claimed' AND NEW.lease_generation <> OLD.lease_generation))
        AND current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
        AND NOT (
            coalesce(current_setting('workflow_delivery.actor', true), '') = ''
            AND (
                (OLD.status = 'pending' AND NEW.status = 'claimed')
                OR (OLD.status = 'claimed' AND NEW.status IN ('finished', 'failed')
                    AND NEW.lease_generation = OLD.lease_generation
                    AND NEW.last_error_at IS NOT DISTINCT FROM OLD.last_error_at)
            )
        )
    )
    EXECUTE FUNCTION {schema}.wd_record_delivery_departure();

CREATE TRIGGER wd_delivery_timeline_commit
    AFTER INSERT ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
        AND NOT (
            NEW.status = 'pending' AND NEW.lease_generation = 0
            AND coalesce(current_setting('workflow_delivery.actor', true), '') = ''
        )
    )
    EXECUTE FUNCTION {schema}.wd_record_delivery_departure();
"""

REVERSE = r"""
DROP TRIGGER wd_delivery_timeline ON {schema}.workflow_agent_deliveries;
DROP TRIGGER wd_delivery_timeline_commit ON {schema}.workflow_agent_deliveries;
DROP FUNCTION {schema}.wd_record_delivery_departure();

CREATE FUNCTION {schema}.wd_record_deliveries_committed() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    INSERT INTO {schema}.workflow_delivery_timeline
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after, actor)
    SELECT d.community_id, d.id, clock_timestamp(), 'committed', d.lease_generation, d.attempts,
           NULL, d.status,
           coalesce(nullif(current_setting('workflow_delivery.actor', true), ''), 'producer')
      FROM created AS d;
    RETURN NULL;
END
$$;

CREATE FUNCTION {schema}.wd_record_deliveries_moved() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    INSERT INTO {schema}.workflow_delivery_timeline
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after,
         actor, error_type, error_message, error_traceback)
    SELECT n.community_id, n.id, clock_timestamp(), k.kind,
           n.lease_generation, n.attempts, o.status, n.status,
           coalesce(w.actor, CASE WHEN n.status = 'claimed' THEN 'holder'
                                  WHEN n.status = 'pending' AND e.recorded THEN 'holder'
                                  WHEN n.status = 'pending' THEN 'sql'
                                  WHEN o.status = 'claimed' THEN 'holder'
                                  ELSE 'sql' END),
           CASE WHEN k.carries THEN n.last_error_type END,
           CASE WHEN k.carries THEN n.last_error_message END,
           CASE WHEN k.carries THEN w.traceback END
      FROM moved_new AS n
      JOIN moved_old AS o ON o.id = n.id
     CROSS JOIN (
           SELECT a.actor, coalesce(a.actor = 'operator' OR a.actor LIKE 'operator:%', false)
                  AS operator,
                  nullif(current_setting('workflow_delivery.error_traceback', true), '')
                  AS traceback
             FROM (SELECT nullif(current_setting('workflow_delivery.actor', true), '') AS actor) AS a
     ) AS w
     CROSS JOIN LATERAL (
           SELECT n.last_error_type IS NOT NULL
                  AND n.last_error_at IS DISTINCT FROM o.last_error_at AS recorded
     ) AS e
     CROSS JOIN LATERAL (
           SELECT CASE
                      WHEN n.status = 'claimed' THEN 'claimed'
                      WHEN n.status = 'pending' AND e.recorded THEN 'retried'
                      WHEN n.status = 'pending' THEN
                          CASE WHEN w.actor = 'reaper' OR (w.actor IS NULL AND o.lease_until < now())
                               THEN 'reaped' ELSE 'released' END
                      WHEN n.status = 'failed' AND w.actor = 'reaper' THEN 'attempts_exhausted'
                      WHEN n.status = 'failed' AND w.operator THEN 'operator_failed'
                      WHEN n.status = 'failed' AND e.recorded
                           AND n.lease_generation > o.lease_generation THEN 'attempts_exhausted'
                      ELSE n.status
                  END AS kind
     ) AS k0
     CROSS JOIN LATERAL (
           SELECT k0.kind,
                  e.recorded AND k0.kind IN ('retried', 'failed', 'attempts_exhausted') AS carries
     ) AS k
     WHERE n.status IS DISTINCT FROM o.status;
    RETURN NULL;
END
$$;

CREATE TRIGGER wd_delivery_timeline
    AFTER UPDATE ON {schema}.workflow_agent_deliveries
    REFERENCING OLD TABLE AS moved_old NEW TABLE AS moved_new
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.wd_record_deliveries_moved();

CREATE TRIGGER wd_delivery_timeline_commit
    AFTER INSERT ON {schema}.workflow_agent_deliveries
    REFERENCING NEW TABLE AS created
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.wd_record_deliveries_committed();

DROP TRIGGER wd_delivery_attempts_start ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_attempts_start
    BEFORE INSERT ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (NEW.attempts > 0)
    EXECUTE FUNCTION {schema}.wd_count_delivery_attempts();

DROP TRIGGER wd_delivery_attempts ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_attempts
    BEFORE UPDATE ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        (OLD.status = 'pending' AND NEW.status = 'claimed')
        OR (NEW.attempts IS DISTINCT FROM OLD.attempts AND NEW.attempts >= 0)
    )
    EXECUTE FUNCTION {schema}.wd_count_delivery_attempts();

CREATE OR REPLACE FUNCTION {schema}.wd_count_delivery_attempts() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        RAISE EXCEPTION 'delivery %: a new delivery has no attempts (attempts = %)', NEW.id, NEW.attempts
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_attempts_count_claims', TABLE = TG_TABLE_NAME;
    END IF;
    IF OLD.status = 'pending' AND NEW.status = 'claimed' THEN
        NEW.attempts := OLD.attempts + 1;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'delivery %: attempts counts claims and changes only by one (% -> %)',
        OLD.id, OLD.attempts, NEW.attempts
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_delivery_attempts_count_claims', TABLE = TG_TABLE_NAME;
END
$$;
"""


def _in_schema(template: str):
    """A migration step running ``template`` with ``{schema}`` as the schema the app
    is migrated into, quoted."""

    def run(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute("SELECT current_schema()")
            (schema,) = cursor.fetchone()
            quoted = schema_editor.connection.ops.quote_name(schema)
            cursor.execute(template.replace("{schema}", quoted))

    return run


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0016_community_agents")]

    operations = [
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="last_claimed_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE)),
    ]
