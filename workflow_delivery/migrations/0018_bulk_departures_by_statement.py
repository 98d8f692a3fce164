"""Bulk departures write their timeline entries in their own statement.

A reap, an operator's release or fail is a departure from the usual life, so under
0017's row trigger each row called ``wd_record_delivery_departure()`` and ran its own
INSERT (two, when its claim was not stored yet). The reaper's batch statement and the
operator's release and fail statements (``workflow_delivery.sql``) now write those
entries themselves, in one INSERT from their UPDATE's RETURNING: for each row the
claim it ends (unless an entry records it already) and then its own entry, as the
function would write them.

So that nothing is written twice, ``wd_delivery_timeline`` passes over a row while
the transaction's ``workflow_delivery.recorded_by_statement`` is ``on``. Such a
statement turns it on before it writes any row and off again once its UPDATE is done,
so the setting never outlives the statement, inside a caller's transaction too. The
setting is read last in the WHEN clause: the usual life never gets to it.

Reversing restores 0017's trigger.
"""

from django.db import migrations

# 0017's condition, then the statement's own say.
FORWARD = r"""
DROP TRIGGER wd_delivery_timeline ON {schema}.workflow_agent_deliveries;
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
        AND current_setting('workflow_delivery.recorded_by_statement', true)
            IS DISTINCT FROM 'on'
    )
    EXECUTE FUNCTION {schema}.wd_record_delivery_departure();
"""

REVERSE = r"""
DROP TRIGGER wd_delivery_timeline ON {schema}.workflow_agent_deliveries;
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
    dependencies = [("workflow_delivery", "0017_implied_timeline")]

    operations = [migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE))]
