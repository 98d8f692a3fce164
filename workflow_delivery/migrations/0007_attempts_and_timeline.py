"""Attempts, a per-delivery timeline, and an index for retention.

* ``attempts`` counts claims. The database keeps the count, so every claim statement
  (one row or a batch, the service's or a raw UPDATE) counts: ``wd_delivery_attempts``
  sets it to the old count + 1 whenever a row goes pending -> claimed and refuses any
  other change of it (it never decreases); a new delivery starts at 0.
* ``workflow_delivery_timeline`` is a tenant table recording each status change of a
  delivery (time by the database clock, generation, attempts, status before and after,
  actor). ``wd_delivery_timeline`` writes it AFTER INSERT/UPDATE, so a raw UPDATE is
  recorded too (a session may turn it off: ``workflow_delivery.timeline = off``, which
  the app sets when ``WORKFLOW_DELIVERY_TIMELINE`` is False; it costs claim+finish
  throughput). The actor comes from the transaction-local setting
  ``workflow_delivery.actor`` (the reaper and operator services set it) or is inferred.
  It references its delivery by ``(community_id, delivery_id)`` and is deleted with it;
  the community write fence guards it like every tenant table.
* ``wd_community_prune_allowed(id)``: like ``community_write_allowed`` but never waits:
  a community whose deletion lock is taken is skipped for this sweep.
* ``wd_delivery_settled_idx`` lets pruning and the per-status counts of terminal rows
  read an index of terminal rows instead of the table. (Built by a plain CREATE INDEX:
  a site with a large table may build it CONCURRENTLY beforehand under the same name.)
"""

import django.db.models.deletion
from django.db import migrations, models

TIMELINE = "workflow_delivery_timeline"

ATTEMPTS = r"""
CREATE FUNCTION wd_count_delivery_attempts() RETURNS trigger
LANGUAGE plpgsql
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

-- WHEN clauses: every other write (renew, finish, reap) never enters the function.
-- (A negative value is left for wd_delivery_attempts_nonneg to report.)
CREATE TRIGGER wd_delivery_attempts
    BEFORE UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        (OLD.status = 'pending' AND NEW.status = 'claimed')
        OR (NEW.attempts IS DISTINCT FROM OLD.attempts AND NEW.attempts >= 0)
    )
    EXECUTE FUNCTION wd_count_delivery_attempts();

CREATE TRIGGER wd_delivery_attempts_start
    BEFORE INSERT ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (NEW.attempts > 0)
    EXECUTE FUNCTION wd_count_delivery_attempts();
"""

REVERSE_ATTEMPTS = """
DROP TRIGGER wd_delivery_attempts_start ON workflow_agent_deliveries;
DROP TRIGGER wd_delivery_attempts ON workflow_agent_deliveries;
DROP FUNCTION wd_count_delivery_attempts();
"""

TIMELINE_SQL = rf"""
ALTER TABLE {TIMELINE}
    ADD CONSTRAINT wd_timeline_delivery_fk FOREIGN KEY (community_id, delivery_id)
        REFERENCES workflow_agent_deliveries (community_id, id) ON DELETE CASCADE;

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
    INSERT INTO {TIMELINE}
        (community_id, delivery_id, at, kind, generation, attempts, status_before, status_after, actor)
    VALUES (NEW.community_id, NEW.id, clock_timestamp(), v_kind, NEW.lease_generation, NEW.attempts,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.status END, NEW.status, v_actor);
    RETURN NULL;
END
$$;

-- Renewals (lease_until only) are not recorded: they are the holder's heartbeat. A
-- session that sets workflow_delivery.timeline to 'off' (the app does, with
-- WORKFLOW_DELIVERY_TIMELINE = False) records nothing and pays only the WHEN test.
CREATE TRIGGER wd_delivery_timeline
    AFTER UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.status IS DISTINCT FROM OLD.status
        AND current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
    )
    EXECUTE FUNCTION wd_record_delivery_transition();

CREATE TRIGGER wd_delivery_timeline_commit
    AFTER INSERT ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off')
    EXECUTE FUNCTION wd_record_delivery_transition();
"""

REVERSE_TIMELINE = f"""
DROP TRIGGER wd_delivery_timeline_commit ON workflow_agent_deliveries;
DROP TRIGGER wd_delivery_timeline ON workflow_agent_deliveries;
DROP FUNCTION wd_record_delivery_transition();
ALTER TABLE {TIMELINE} DROP CONSTRAINT wd_timeline_delivery_fk;
"""

PRUNE = r"""
CREATE FUNCTION wd_community_prune_allowed(p_community_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM wd_require_read_committed();
    -- A try, never a wait: an executor holding the exclusive lock means this tenant
    -- is skipped for this sweep. Once held, the state is read with a fresh snapshot,
    -- so a transition committed just before is seen.
    IF NOT pg_try_advisory_xact_lock_shared(wd_community_deletion_key(p_community_id)) THEN
        RETURN false;
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM communities WHERE id = p_community_id AND deletion_state = 'active'
    );
END
$$;
"""

REVERSE_PRUNE = "DROP FUNCTION wd_community_prune_allowed(uuid);"


class Migration(migrations.Migration):
    dependencies = [
        ("workflow_delivery", "0006_hardening"),
    ]

    operations = [
        migrations.CreateModel(
            name="DeliveryTransition",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("at", models.DateTimeField()),
                (
                    "kind",
                    models.TextField(
                        choices=[
                            ("committed", "Committed"),
                            ("claimed", "Claimed"),
                            ("finished", "Finished"),
                            ("failed", "Failed"),
                            ("reaped", "Reaped"),
                            ("released", "Released"),
                            ("operator_failed", "Operator Failed"),
                            ("attempts_exhausted", "Attempts Exhausted"),
                        ]
                    ),
                ),
                ("generation", models.BigIntegerField()),
                ("attempts", models.IntegerField()),
                ("status_before", models.TextField(blank=True, null=True)),
                ("status_after", models.TextField()),
                ("actor", models.TextField()),
            ],
            options={
                "db_table": "workflow_delivery_timeline",
                "ordering": ["community_id", "delivery_id", "id"],
            },
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="attempts",
            field=models.IntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AddIndex(
            model_name="workflowagentdelivery",
            index=models.Index(
                condition=models.Q(("status__in", ["finished", "failed"])),
                fields=["community", "status", "finished_at"],
                name="wd_delivery_settled_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(("attempts__gte", 0)), name="wd_delivery_attempts_nonneg"
            ),
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="community",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="workflow_delivery.community",
            ),
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="delivery",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="timeline",
                to="workflow_delivery.workflowagentdelivery",
            ),
        ),
        migrations.AddIndex(
            model_name="deliverytransition",
            index=models.Index(
                fields=["community", "delivery", "id"], name="wd_timeline_delivery_idx"
            ),
        ),
        migrations.AddIndex(
            model_name="deliverytransition",
            index=models.Index(
                condition=models.Q(
                    ("kind__in", ["finished", "failed", "operator_failed", "attempts_exhausted"])
                ),
                fields=["at"],
                name="wd_timeline_settle_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "kind__in",
                        [
                            "committed",
                            "claimed",
                            "finished",
                            "failed",
                            "reaped",
                            "released",
                            "operator_failed",
                            "attempts_exhausted",
                        ],
                    )
                ),
                name="wd_timeline_kind_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(("actor__regex", "\\S")), name="wd_timeline_actor_not_blank"
            ),
        ),
        migrations.RunSQL(sql=ATTEMPTS, reverse_sql=REVERSE_ATTEMPTS),
        migrations.RunSQL(sql=TIMELINE_SQL, reverse_sql=REVERSE_TIMELINE),
        migrations.RunSQL(
            sql=(
                "CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE "
                "ON workflow_delivery_timeline FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();"
            ),
            reverse_sql="DROP TRIGGER wd_community_write_fence ON workflow_delivery_timeline;",
        ),
        migrations.RunSQL(sql=PRUNE, reverse_sql=REVERSE_PRUNE),
    ]
