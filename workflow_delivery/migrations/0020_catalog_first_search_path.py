"""Every function of the app resolves names in ``pg_catalog`` first, and calls the
catalog's functions by their qualified names.

A function pinned to ``<schema>, pg_catalog, pg_temp`` looks in the app's schema
before the catalog: a role that may create in that schema (PUBLIC may, on a database
made by PostgreSQL 14 or earlier) could plant ``<schema>.pg_backend_pid()`` and have a
SECURITY DEFINER function, or a trigger fired by the owner, run it as the owner.

* Every app function (``wd_…`` and ``community_write_allowed``, in the schema the app
  is migrated into) is pinned to ``search_path = pg_catalog, <schema>, pg_temp``:
  the catalog first, the app's schema for its own tables and functions, temporary
  objects (searched first when not named) last.
* Each body's calls of the catalog functions it uses are rewritten as
  ``pg_catalog.<name>(…)``, so a body reads as what it runs whatever the path.

The step is dynamic: it rewrites whatever app functions exist when it runs. Reversing
pins the functions back to ``<schema>, pg_catalog, pg_temp``; the qualified calls stay
(they name the functions the unqualified ones resolved to).
"""

from django.db import migrations

# The app's functions in the schema it is migrated into (extensions' excluded).
_APP_FUNCTIONS = r"""
SELECT p.oid::regprocedure
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = current_schema())
   AND (p.proname LIKE 'wd\_%' OR p.proname = 'community_write_allowed')
   AND NOT EXISTS (
       SELECT 1 FROM pg_catalog.pg_depend d
        WHERE d.classid = 'pg_catalog.pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
   )
"""

# Every catalog function a body of the app calls.
_CATALOG_CALLS = "|".join(
    (
        "clock_timestamp",
        "current_database",
        "current_setting",
        "encode",
        "format",
        "hashtextextended",
        "now",
        "pg_advisory_xact_lock",
        "pg_advisory_xact_lock_shared",
        "pg_backend_pid",
        "pg_current_xact_id",
        "pg_current_xact_id_if_assigned",
        "pg_get_userbyid",
        "pg_try_advisory_xact_lock",
        "pg_try_advisory_xact_lock_shared",
        "set_config",
        "upper",
    )
)

FORWARD = rf"""
DO $do$
DECLARE
    v_function regprocedure;
    v_definition text;
    v_qualified text;
BEGIN
    FOR v_function IN {_APP_FUNCTIONS} LOOP
        v_definition := pg_catalog.pg_get_functiondef(v_function);
        -- A call not already qualified (no dot, quote or name character before it).
        v_qualified := pg_catalog.regexp_replace(
            v_definition,
            '(?<![."[:alnum:]_])({_CATALOG_CALLS})\s*\(',
            'pg_catalog.\1(',
            'g'
        );
        IF v_qualified <> v_definition THEN
            EXECUTE v_qualified;
        END IF;
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            v_function, current_schema()
        );
    END LOOP;
END
$do$;
"""

REVERSE = rf"""
DO $do$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN {_APP_FUNCTIONS} LOOP
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = %I, pg_catalog, pg_temp',
            v_function, current_schema()
        );
    END LOOP;
END
$do$;
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0019_request_refusal")]

    operations = [migrations.RunSQL(sql=FORWARD, reverse_sql=REVERSE)]
