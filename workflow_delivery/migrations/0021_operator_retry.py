"""An operator's retry of a failed delivery.

* ``attempts_at_retry``: the ``attempts`` a delivery had when an operator last returned
  it from ``failed`` to ``pending``; the attempts cap counts the claims since, so a
  retry renews the budget while ``attempts`` keeps counting every claim. Never below 0
  nor above ``attempts`` (``wd_delivery_attempts_at_retry_range``).
* ``wd_delivery_transition_guard`` lets a ``failed`` row go back to ``pending``; every
  other change of a terminal row stays refused, and a ``finished`` row never reopens.
  ``wd_delivery_retry_guard`` holds that way back to its rules
  (``wd_delivery_retry_renews``): the fence is bumped (a stale holder is fenced out),
  ``attempts_at_retry`` becomes ``attempts``, the lease stays clear, the recorded error
  is kept; and ``attempts_at_retry`` changes on that way back and nowhere else.
* The timeline gains the kind ``operator_retried`` and ``reason``: such an entry always
  carries the operator's reason, no other entry does (``wd_timeline_reason_of_retry``),
  at most 500 characters (``wd_timeline_reason_length``).
* The permission ``retry_delivery``.

Functions pin ``search_path`` to the schema the app is migrated into, as every
function of the app does.
"""

import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

FORWARD = r"""
DROP TRIGGER wd_delivery_transition_guard ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_transition_guard
    AFTER UPDATE ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        NEW.lease_generation < OLD.lease_generation
        OR (NEW.id, NEW.community_id) IS DISTINCT FROM (OLD.id, OLD.community_id)
        OR (
            OLD.status IN ('finished', 'failed')
            AND NOT (OLD.status = 'failed' AND NEW.status = 'pending')
            AND (NEW.status, NEW.finished_at, NEW.last_error_type, NEW.last_error_message,
                 NEW.last_error_at)
                IS DISTINCT FROM (OLD.status, OLD.finished_at, OLD.last_error_type,
                                  OLD.last_error_message, OLD.last_error_at)
        )
    )
    EXECUTE FUNCTION {schema}.wd_reject_delivery_transition();

CREATE FUNCTION {schema}.wd_guard_delivery_retry() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, {schema}, pg_temp
AS $$
BEGIN
    IF OLD.status = 'finished' AND NEW.status IS DISTINCT FROM OLD.status THEN
        RETURN NULL;  -- wd_delivery_transition_guard refuses it, as terminal once
    END IF;
    IF OLD.status = 'failed' AND NEW.status = 'pending'
       AND NEW.lease_generation > OLD.lease_generation
       AND NEW.attempts = OLD.attempts AND NEW.attempts_at_retry = OLD.attempts
       AND (NEW.last_error_type, NEW.last_error_message, NEW.last_error_at)
           IS NOT DISTINCT FROM (OLD.last_error_type, OLD.last_error_message, OLD.last_error_at)
    THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'delivery %: only a retry of a failed delivery renews its attempts, and it bumps lease_generation, sets attempts_at_retry to attempts and keeps the recorded error (% -> %, generation % -> %, attempts_at_retry % -> %)',
        OLD.id, OLD.status, NEW.status, OLD.lease_generation, NEW.lease_generation,
        OLD.attempts_at_retry, NEW.attempts_at_retry
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_delivery_retry_renews', TABLE = TG_TABLE_NAME;
END
$$;

CREATE TRIGGER wd_delivery_retry_guard
    AFTER UPDATE ON {schema}.workflow_agent_deliveries
    FOR EACH ROW
    WHEN (
        (OLD.status = 'failed' AND NEW.status = 'pending')
        OR NEW.attempts_at_retry IS DISTINCT FROM OLD.attempts_at_retry
    )
    EXECUTE FUNCTION {schema}.wd_guard_delivery_retry();
"""

REVERSE = r"""
DROP TRIGGER wd_delivery_retry_guard ON {schema}.workflow_agent_deliveries;
DROP FUNCTION {schema}.wd_guard_delivery_retry();
DROP TRIGGER wd_delivery_transition_guard ON {schema}.workflow_agent_deliveries;
CREATE TRIGGER wd_delivery_transition_guard
    AFTER UPDATE ON {schema}.workflow_agent_deliveries
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
    EXECUTE FUNCTION {schema}.wd_reject_delivery_transition();
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
    dependencies = [
        ("workflow_delivery", "0020_catalog_first_search_path"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="workflowagentdelivery",
            options={
                "ordering": ["-created_at", "id"],
                "permissions": [
                    ("reap_deliveries", "Can reap expired delivery leases"),
                    ("release_delivery", "Can release the lease of a claimed delivery"),
                    ("fail_delivery", "Can mark a delivery failed (operator terminal)"),
                    (
                        "retry_delivery",
                        "Can retry a failed delivery (back to pending, attempts renewed)",
                    ),
                ],
                "verbose_name": "workflow agent delivery",
                "verbose_name_plural": "workflow agent deliveries",
            },
        ),
        migrations.RemoveConstraint(
            model_name="deliverytransition",
            name="wd_timeline_kind_valid",
        ),
        migrations.AddField(
            model_name="deliverytransition",
            name="reason",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="attempts_at_retry",
            field=models.IntegerField(db_default=0, default=0, editable=False),
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
                    ("operator_retried", "Operator Retried"),
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
                            "operator_retried",
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
                        ("reason__isnull", True),
                        models.Q(("kind", "operator_retried"), _negated=True),
                    ),
                    models.Q(
                        ("kind", "operator_retried"),
                        ("reason__isnull", False),
                        ("reason__regex", "\\S"),
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_reason_of_retry",
            ),
        ),
        migrations.AddConstraint(
            model_name="deliverytransition",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("reason__isnull", True),
                    django.db.models.lookups.LessThanOrEqual(
                        django.db.models.functions.text.Length("reason"), 500
                    ),
                    _connector="OR",
                ),
                name="wd_timeline_reason_length",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("attempts_at_retry__gte", 0),
                    models.Q(
                        ("attempts_at_retry__lte", models.F("attempts")),
                        ("attempts__lt", 0),
                        _connector="OR",
                    ),
                ),
                name="wd_delivery_attempts_at_retry_range",
            ),
        ),
        migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE)),
    ]
