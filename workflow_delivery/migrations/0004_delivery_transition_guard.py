"""Rules of a delivery's life that a CHECK cannot see because they compare the old
row with the new: the fencing token never decreases, and a terminal outcome is
recorded once and never changes. An AFTER trigger with a WHEN clause costs nothing
on the rows it lets through, and lets CHECK constraints report first."""

from django.db import migrations

GUARD = r"""
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

REVERSE = """
DROP TRIGGER wd_delivery_transition_guard ON workflow_agent_deliveries;
DROP FUNCTION wd_reject_delivery_transition();
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0003_community_write_fence")]

    operations = [migrations.RunSQL(sql=GUARD, reverse_sql=REVERSE)]
