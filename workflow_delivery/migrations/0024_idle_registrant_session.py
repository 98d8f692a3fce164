"""Who waits for an idle registration's wake-up: ``pid`` and ``backend_start`` of
``workflow_delivery_idle_wake_targets``.

A registration names the database session that listens for its wake-up: its
``pg_backend_pid()`` and that backend's ``backend_start`` (together they tell a live
session from a later one that reuses the pid). A consumer that stops cleanly takes its
registrations back; one that dies leaves them, and the admin's "why not delivered?"
page joins ``pg_stat_activity`` on the pair to tell a waiting consumer from a gone one.

* Both columns are NOT NULL. Their defaults name the inserting session
  (``pg_catalog.pg_backend_pid()`` and ``wd_session_started()``), so an insert that
  does not name a session, as an earlier version's does, still records one.
* ``wd_session_started()``: the calling backend's ``backend_start``, read from
  ``pg_catalog.pg_stat_get_activity`` for its own pid (a session always sees its own
  row). It pins ``search_path`` as every function of the app does.
* The table's rows are emptied first: they are hints of an unlogged table, and a
  waiting consumer registers again at its next poll.
"""

from django.db import migrations, models

FORWARD = r"""
TRUNCATE {schema}.workflow_delivery_idle_wake_targets;

CREATE FUNCTION {schema}.wd_session_started() RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path = pg_catalog, {schema}, pg_temp
AS $$
    SELECT a.backend_start
      FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a
$$;

ALTER TABLE {schema}.workflow_delivery_idle_wake_targets
    ADD COLUMN pid integer NOT NULL DEFAULT pg_catalog.pg_backend_pid(),
    ADD COLUMN backend_start timestamptz NOT NULL DEFAULT {schema}.wd_session_started();
"""

REVERSE = r"""
ALTER TABLE {schema}.workflow_delivery_idle_wake_targets
    DROP COLUMN backend_start,
    DROP COLUMN pid;
DROP FUNCTION {schema}.wd_session_started();
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
        ("workflow_delivery", "0023_agent_turns"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="idlewaketarget",
                    name="pid",
                    field=models.IntegerField(editable=False),
                ),
                migrations.AddField(
                    model_name="idlewaketarget",
                    name="backend_start",
                    field=models.DateTimeField(editable=False),
                ),
            ],
            database_operations=[
                migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE)),
            ],
        ),
    ]
