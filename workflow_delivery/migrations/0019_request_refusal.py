"""``wd_refuse_request(code)``: raise the refusal of an agent API request from inside
the statement that serves it.

The API admits a request and runs its operation in one statement, in autocommit, so
the replay-guard row that statement inserts commits with the operation. When the
operation itself refuses (a renew or finish whose lease is lost), the statement calls
this function, and the error rolls back everything it did, the replay row included:
the refused request leaves nothing behind. The error names the constraint
``wd_request_refused`` and carries the refusal's code as its message.

The function pins ``search_path`` to the schema the app is migrated into, as every
function of the app does (migration 0015).
"""

from django.db import migrations

FORWARD = r"""
CREATE FUNCTION {schema}.wd_refuse_request(p_code text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = {schema}, pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = p_code,
        CONSTRAINT = 'wd_request_refused',
        DETAIL = 'the agent API refused the request; nothing it did is kept';
END
$$;
"""

REVERSE = "DROP FUNCTION {schema}.wd_refuse_request(text);"


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
    dependencies = [("workflow_delivery", "0018_bulk_departures_by_statement")]

    operations = [migrations.RunPython(_in_schema(FORWARD), _in_schema(REVERSE))]
