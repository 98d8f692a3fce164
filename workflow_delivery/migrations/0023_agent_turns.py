"""What an ACP agent said in a turn: ``workflow_delivery_agent_turns``.

A tenant table, one row per attempt of a delivery (``wd_agent_turn_once``:
``(community_id, delivery_id, attempts)``, which also leads by ``community_id``),
written by the ACP runtime in the transaction of the settle that ended the attempt.

* ``wd_agent_turn_delivery_fk``: ``(community_id, delivery_id)`` references the
  delivery, deleted with it; ``wd_agent_turn_community_fk``: the community.
* ``text`` holds at most 1 MiB (``wd_agent_turn_text_bytes``, in UTF-8 bytes: the
  ceiling of the runtime's setting); ``said_bytes`` counts what the agent said, never
  less than what is kept (``wd_agent_turn_said_covers_text``), so a cut text shows.
  ``tool_calls`` and ``permissions`` are JSON arrays of at most 200 entries.
* ``wd_agent_turn_settled``: a row is written only for an attempt the delivery has
  left: the delivery counts that attempt (``attempts``) and no longer holds that
  lease (``status`` is not ``claimed`` at that ``lease_generation``). A stored row is
  never changed (``wd_agent_turn_kept``).
* The community write fence guards it like every tenant table.

Functions pin ``search_path`` to the schema the app is migrated into, as every
function of the app does.
"""

import django.contrib.postgres.functions
import django.db.models.deletion
import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

FORWARD = r"""
ALTER TABLE {schema}.workflow_delivery_agent_turns
    ADD CONSTRAINT wd_agent_turn_delivery_fk FOREIGN KEY (community_id, delivery_id)
        REFERENCES {schema}.workflow_agent_deliveries (community_id, id) ON DELETE CASCADE,
    ADD CONSTRAINT wd_agent_turn_community_fk FOREIGN KEY (community_id)
        REFERENCES {schema}.communities (id) ON DELETE RESTRICT;

CREATE FUNCTION {schema}.wd_check_agent_turn_settled() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, {schema}, pg_temp
AS $$
DECLARE
    v_status text;
    v_generation bigint;
    v_attempts integer;
BEGIN
    SELECT d.status, d.lease_generation, d.attempts
      INTO v_status, v_generation, v_attempts
      FROM workflow_agent_deliveries AS d
     WHERE d.community_id = NEW.community_id AND d.id = NEW.delivery_id;
    IF NOT FOUND THEN
        RETURN NEW;  -- wd_agent_turn_delivery_fk reports it
    END IF;
    IF v_attempts = NEW.attempts
       AND NOT (v_status = 'claimed' AND v_generation = NEW.generation)
       AND v_generation >= NEW.generation
    THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'delivery %: a turn is stored only with the settle of its attempt (turn of attempt % at generation %; the delivery is % at attempt %, generation %)',
        NEW.delivery_id, NEW.attempts, NEW.generation, v_status, v_attempts, v_generation
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_agent_turn_settled', TABLE = TG_TABLE_NAME;
END
$$;

CREATE TRIGGER wd_agent_turn_settled
    BEFORE INSERT ON {schema}.workflow_delivery_agent_turns
    FOR EACH ROW
    EXECUTE FUNCTION {schema}.wd_check_agent_turn_settled();

CREATE FUNCTION {schema}.wd_keep_agent_turn() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, {schema}, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'agent turn %: a stored turn is never changed', OLD.id
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'wd_agent_turn_kept', TABLE = TG_TABLE_NAME;
END
$$;

CREATE TRIGGER wd_agent_turn_kept
    BEFORE UPDATE ON {schema}.workflow_delivery_agent_turns
    FOR EACH ROW
    EXECUTE FUNCTION {schema}.wd_keep_agent_turn();

CREATE TRIGGER wd_community_write_fence
    BEFORE INSERT OR UPDATE OR DELETE ON {schema}.workflow_delivery_agent_turns
    FOR EACH ROW
    EXECUTE FUNCTION {schema}.wd_enforce_community_write_fence();
"""

REVERSE = r"""
DROP TRIGGER wd_community_write_fence ON {schema}.workflow_delivery_agent_turns;
DROP TRIGGER wd_agent_turn_kept ON {schema}.workflow_delivery_agent_turns;
DROP FUNCTION {schema}.wd_keep_agent_turn();
DROP TRIGGER wd_agent_turn_settled ON {schema}.workflow_delivery_agent_turns;
DROP FUNCTION {schema}.wd_check_agent_turn_settled();
ALTER TABLE {schema}.workflow_delivery_agent_turns
    DROP CONSTRAINT wd_agent_turn_community_fk,
    DROP CONSTRAINT wd_agent_turn_delivery_fk;
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
        ("workflow_delivery", "0022_event_json_content"),
    ]

    operations = [
        migrations.CreateModel(
            name="AgentTurn",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("attempts", models.IntegerField()),
                ("generation", models.BigIntegerField()),
                (
                    "settled_at",
                    models.DateTimeField(
                        db_default=django.contrib.postgres.functions.TransactionNow(),
                        editable=False,
                    ),
                ),
                (
                    "outcome",
                    models.TextField(
                        choices=[
                            ("finished", "Finished"),
                            ("failed", "Failed"),
                            ("retried", "Retried"),
                        ]
                    ),
                ),
                ("stop_reason", models.TextField(blank=True, null=True)),
                ("text", models.TextField(blank=True, default="")),
                ("said_bytes", models.IntegerField()),
                ("tool_calls", models.JSONField(default=list)),
                ("permissions", models.JSONField(default=list)),
                (
                    "community",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="workflow_delivery.community",
                    ),
                ),
                (
                    "delivery",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="agent_turns",
                        to="workflow_delivery.workflowagentdelivery",
                    ),
                ),
            ],
            options={
                "db_table": "workflow_delivery_agent_turns",
                "ordering": ["community_id", "delivery_id", "attempts"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("community", "delivery", "attempts"), name="wd_agent_turn_once"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("outcome__in", ["finished", "failed", "retried"])),
                        name="wd_agent_turn_outcome_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("attempts__gte", 1), ("generation__gte", 1)),
                        name="wd_agent_turn_claimed",
                    ),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.LessThanOrEqual(
                            models.Func(
                                models.F("text"),
                                function="octet_length",
                                output_field=models.IntegerField(),
                            ),
                            1048576,
                        ),
                        name="wd_agent_turn_text_bytes",
                    ),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.GreaterThanOrEqual(
                            models.F("said_bytes"),
                            models.Func(
                                models.F("text"),
                                function="octet_length",
                                output_field=models.IntegerField(),
                            ),
                        ),
                        name="wd_agent_turn_said_covers_text",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("stop_reason__isnull", True),
                            django.db.models.lookups.LessThanOrEqual(
                                django.db.models.functions.text.Length("stop_reason"), 100
                            ),
                            _connector="OR",
                        ),
                        name="wd_agent_turn_stop_reason_length",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            django.db.models.lookups.Exact(
                                models.Func(
                                    models.F("tool_calls"),
                                    function="jsonb_typeof",
                                    output_field=models.TextField(),
                                ),
                                "array",
                            ),
                            django.db.models.lookups.LessThanOrEqual(
                                models.Func(
                                    models.F("tool_calls"),
                                    function="jsonb_array_length",
                                    output_field=models.IntegerField(),
                                ),
                                200,
                            ),
                        ),
                        name="wd_agent_turn_tool_calls_list",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            django.db.models.lookups.Exact(
                                models.Func(
                                    models.F("permissions"),
                                    function="jsonb_typeof",
                                    output_field=models.TextField(),
                                ),
                                "array",
                            ),
                            django.db.models.lookups.LessThanOrEqual(
                                models.Func(
                                    models.F("permissions"),
                                    function="jsonb_array_length",
                                    output_field=models.IntegerField(),
                                ),
                                200,
                            ),
                        ),
                        name="wd_agent_turn_permissions_list",
                    ),
                ],
            },
        ),
        migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE)),
    ]
