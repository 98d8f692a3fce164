"""Retries with backoff, and the holder's last error.

* ``available_at`` on a delivery: a retried delivery's not-before time. Set only on a
  pending row (``wd_delivery_available_at_only_pending``); a claim takes a pending row
  only when it is NULL or not after the claim's clock, and clears it.
* ``last_error_type``, ``last_error_message``, ``last_error_at``: the last error its
  holder reported, all three or none (``wd_delivery_last_error_complete``), bounded
  (``wd_delivery_last_error_type_valid``, ``wd_delivery_last_error_message_length``).
  Once a delivery is terminal they cannot change: ``wd_delivery_transition_guard``
  now also watches them (a settled delivery never reopens, nor does its record).
* The timeline gains the kind ``retried`` and the error of the entry
  (``error_type``, ``error_message``, ``error_traceback``): a retry always carries one
  (``wd_timeline_error_kinds``), and only ``retried``, ``failed`` and
  ``attempts_exhausted`` entries may.
* ``wd_record_deliveries_moved()`` (the statement-level timeline of 0011) writes them.
  A row whose ``last_error_at`` the statement changed recorded an error: back to
  pending it is ``retried`` (actor ``holder``); settled failed with its generation
  bumped it is ``attempts_exhausted`` (the retry found every attempt used); settled
  failed at the same generation it is ``failed`` (the holder's own failure). The
  entry copies the row's error, and the traceback from the transaction-local setting
  ``workflow_delivery.error_traceback`` that the same statement sets.

Reversing restores 0011's function and guard and drops the columns.
"""

import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

TIMELINE = "workflow_delivery_timeline"


RETRY_TIMELINE = rf"""
CREATE OR REPLACE FUNCTION wd_record_deliveries_moved() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    -- As in 0011, plus: a row whose last_error_at this statement changed recorded
    -- an error, which its entry carries (with the statement's traceback setting).
    INSERT INTO {TIMELINE}
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
"""

# 0011's function, restored on reverse.
REVERSE_RETRY_TIMELINE = """\
CREATE OR REPLACE FUNCTION wd_record_deliveries_moved() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('workflow_delivery.timeline', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN NULL;
    END IF;
    -- 0007's row function, row by row: the kind and actor from the new status, the
    -- transaction's actor setting and, for an unnamed return to pending, the lease
    -- it took away.
    INSERT INTO workflow_delivery_timeline
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
$$;"""

# 0011's guard, with the recorded error of a terminal row held as fast as its outcome.
GUARD = """
DROP TRIGGER wd_delivery_transition_guard ON workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_transition_guard
    AFTER UPDATE ON workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.lease_generation < OLD.lease_generation
        OR (NEW.id, NEW.community_id) IS DISTINCT FROM (OLD.id, OLD.community_id)
        OR (
            OLD.status IN ('finished', 'failed')
            AND (NEW.status, NEW.finished_at, NEW.last_error_type, NEW.last_error_message,
                 NEW.last_error_at)
                IS DISTINCT FROM (OLD.status, OLD.finished_at, OLD.last_error_type,
                                  OLD.last_error_message, OLD.last_error_at)
        )
    )
    EXECUTE FUNCTION wd_reject_delivery_transition();
"""

REVERSE_GUARD = """
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


class Migration(migrations.Migration):
    dependencies = [
        ("workflow_delivery", "0013_idle_wake_targets"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="deliverytransition",
            name="wd_timeline_kind_valid",
        ),
        # Reversed (after the error columns are gone, before 0011's kinds return): a
        # retry was a return to pending by its holder, which 0011 calls released.
        migrations.RunSQL(
            sql=migrations.RunSQL.noop,
            reverse_sql=f"UPDATE {TIMELINE} SET kind = 'released' WHERE kind = 'retried'",
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="error_message",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="error_traceback",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="error_type",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="available_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="last_error_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="last_error_message",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="last_error_type",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="deliverytransition",
            name="kind",
            field=models.TextField(
                choices=[
                    ("committed", "Committed"),
                    ("claimed", "Claimed"),
                    ("finished", "Finished"),
                    ("failed", "Failed"),
                    ("reaped", "Reaped"),
                    ("released", "Released"),
                    ("operator_failed", "Operator Failed"),
                    ("attempts_exhausted", "Attempts Exhausted"),
                    ("retried", "Retried"),
                ]
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
                            "retried",
                        ],
                    )
                ),
                name="wd_timeline_kind_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("error_message__isnull", True),
                        ("error_type__isnull", True),
                        ("error_traceback__isnull", True),
                    ),
                    models.Q(("error_message__isnull", False), ("error_type__isnull", False)),
                    _connector="OR",
                ),
                name="wd_timeline_error_complete",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("error_type__isnull", True), models.Q(("kind", "retried"), _negated=True)
                    ),
                    models.Q(
                        ("error_type__isnull", False),
                        ("kind__in", ["retried", "failed", "attempts_exhausted"]),
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_error_kinds",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("error_type__isnull", True),
                    models.Q(
                        django.db.models.lookups.GreaterThanOrEqual(
                            django.db.models.functions.text.Length("error_type"), 1
                        ),
                        django.db.models.lookups.LessThanOrEqual(
                            django.db.models.functions.text.Length("error_type"), 200
                        ),
                        ("error_type__regex", "\\S"),
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_error_type_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("error_message__isnull", True),
                    django.db.models.lookups.LessThanOrEqual(
                        django.db.models.functions.text.Length("error_message"), 2000
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_error_message_length",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("error_traceback__isnull", True),
                    django.db.models.lookups.LessThanOrEqual(
                        django.db.models.functions.text.Length("error_traceback"), 16000
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_error_traceback_length",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("available_at__isnull", True), ("status", "pending"), _connector="OR"
                ),
                name="wd_delivery_available_at_only_pending",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("last_error_at__isnull", True),
                        ("last_error_message__isnull", True),
                        ("last_error_type__isnull", True),
                    ),
                    models.Q(
                        ("last_error_at__isnull", False),
                        ("last_error_message__isnull", False),
                        ("last_error_type__isnull", False),
                    ),
                    _connector="OR",
                ),
                name="wd_delivery_last_error_complete",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("last_error_type__isnull", True),
                    models.Q(
                        django.db.models.lookups.GreaterThanOrEqual(
                            django.db.models.functions.text.Length("last_error_type"), 1
                        ),
                        django.db.models.lookups.LessThanOrEqual(
                            django.db.models.functions.text.Length("last_error_type"), 200
                        ),
                        ("last_error_type__regex", "\\S"),
                    ),
                    _connector="OR",
                ),
                name="wd_delivery_last_error_type_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("last_error_message__isnull", True),
                    django.db.models.lookups.LessThanOrEqual(
                        django.db.models.functions.text.Length("last_error_message"), 2000
                    ),
                    _connector="OR",
                ),
                name="wd_delivery_last_error_message_length",
            ),
        ),
        migrations.RunSQL(sql=GUARD, reverse_sql=REVERSE_GUARD),
        migrations.RunSQL(sql=RETRY_TIMELINE, reverse_sql=REVERSE_RETRY_TIMELINE),
    ]
