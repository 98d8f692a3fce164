"""The app's functions resolve names only in the app's schema, and the deletion
executor's authority is something a writer cannot present.

* Every function of the app (``wd_…`` and ``community_write_allowed``, in the schema
  the app is migrated into) runs with ``search_path = <schema>, pg_catalog, pg_temp``.
  Without it an unqualified ``communities`` or timeline table inside a trigger could
  be a session's temporary table, which PostgreSQL searches first: a fake active row
  let a write into a tenant that is not active through. The step is dynamic (it pins
  whatever app functions exist when it runs), so it stays after every migration that
  adds or replaces one.
* The executor presents itself by ``wd_present_executor(community, generation)``, a
  SECURITY DEFINER function executable by its owner and by the roles it is granted
  to, never by PUBLIC. It requires the community's exclusive deletion lock and records
  the presentation in ``wd_executor_presentations``, keyed by backend pid and
  transaction id, a table only its owner writes. ``wd_holds_community_deletion_lock``,
  the fence's proof that a transaction is the executor, now also asks for that
  record at the community's current fence generation; 0006's lock test lives on as
  ``wd_backend_holds_community_deletion_lock``. The advisory lock and the settings
  alone, which any role can take and set, authorise nothing.

Reversing drops the presentation and unpins the functions.
"""

from django.db import migrations

PRESENTATIONS = "wd_executor_presentations"

EXECUTOR_AUTHORITY = rf"""
ALTER FUNCTION wd_holds_community_deletion_lock(uuid)
    RENAME TO wd_backend_holds_community_deletion_lock;

-- The executor's presentations: each lives inside its own transaction (withdrawn
-- before commit, rolled back with an error), and a row of an earlier transaction
-- can never match a later one, since transaction ids are not reused.
CREATE TABLE {PRESENTATIONS} (
    backend_pid integer NOT NULL,
    transaction_id xid8 NOT NULL,
    executor_of uuid NOT NULL,
    fence_generation bigint NOT NULL,
    CONSTRAINT wd_executor_presentation_per_transaction
        PRIMARY KEY (backend_pid, transaction_id, executor_of)
);
REVOKE ALL ON {PRESENTATIONS} FROM PUBLIC;

-- Even a role granted DML on every table cannot write a presentation: only the
-- owner (so only the SECURITY DEFINER functions below) may.
CREATE FUNCTION wd_refuse_foreign_executor_presentation() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_user <> (SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = TG_RELID) THEN
        RAISE EXCEPTION 'only wd_present_executor() records an executor presentation, not %',
            current_user
            USING ERRCODE = 'insufficient_privilege',
                  CONSTRAINT = 'wd_executor_presentation_by_owner',
                  TABLE = TG_TABLE_NAME;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER wd_executor_presentation_by_owner BEFORE INSERT OR UPDATE ON {PRESENTATIONS}
    FOR EACH ROW EXECUTE FUNCTION wd_refuse_foreign_executor_presentation();

CREATE FUNCTION wd_present_executor(p_community_id uuid, p_generation bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    IF NOT wd_backend_holds_community_deletion_lock(p_community_id) THEN
        RAISE EXCEPTION 'community %: the executor presents itself only under the exclusive deletion lock',
            p_community_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  CONSTRAINT = 'wd_executor_requires_deletion_lock';
    END IF;
    DELETE FROM {PRESENTATIONS}
     WHERE backend_pid = pg_backend_pid() AND transaction_id <> pg_current_xact_id();
    INSERT INTO {PRESENTATIONS} (backend_pid, transaction_id, executor_of, fence_generation)
    VALUES (pg_backend_pid(), pg_current_xact_id(), p_community_id, p_generation)
    ON CONFLICT ON CONSTRAINT wd_executor_presentation_per_transaction
    DO UPDATE SET fence_generation = EXCLUDED.fence_generation;
    -- What the fence compares first (and what a reader of the session sees).
    PERFORM set_config('workflow_delivery.executor_community', p_community_id::text, true),
            set_config('workflow_delivery.executor_generation', p_generation::text, true);
END
$$;

CREATE FUNCTION wd_withdraw_executor() RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    DELETE FROM {PRESENTATIONS} WHERE backend_pid = pg_backend_pid();
    PERFORM set_config('workflow_delivery.executor_community', '', true),
            set_config('workflow_delivery.executor_generation', '', true);
END
$$;

REVOKE EXECUTE ON FUNCTION wd_present_executor(uuid, bigint), wd_withdraw_executor() FROM PUBLIC;

CREATE FUNCTION wd_holds_community_deletion_lock(p_community_id uuid) RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
AS $$
    SELECT wd_backend_holds_community_deletion_lock(p_community_id)
       AND EXISTS (
           SELECT 1
             FROM {PRESENTATIONS} p
             JOIN communities c ON c.id = p.executor_of
            WHERE p.backend_pid = pg_backend_pid()
              AND p.transaction_id = pg_current_xact_id_if_assigned()
              AND p.executor_of = p_community_id
              AND p.fence_generation = c.deletion_fence_generation
       )
$$;

COMMENT ON FUNCTION wd_holds_community_deletion_lock(uuid) IS
    'True when this transaction is the community''s deletion executor: its backend holds the '
    'exclusive deletion lock and it presented itself by wd_present_executor() at the current '
    'fence generation.';
"""

REVERSE_EXECUTOR_AUTHORITY = f"""
DROP FUNCTION wd_holds_community_deletion_lock(uuid);
DROP FUNCTION wd_withdraw_executor();
DROP FUNCTION wd_present_executor(uuid, bigint);
DROP TABLE {PRESENTATIONS};
DROP FUNCTION wd_refuse_foreign_executor_presentation();
ALTER FUNCTION wd_backend_holds_community_deletion_lock(uuid)
    RENAME TO wd_holds_community_deletion_lock;
"""

# The app's functions in the schema it is migrated into (extensions' excluded).
_APP_FUNCTIONS = r"""
SELECT p.oid::regprocedure
  FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND (p.proname LIKE 'wd\_%' OR p.proname = 'community_write_allowed')
   AND NOT EXISTS (
       SELECT 1 FROM pg_depend d
        WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
   )
"""

PIN = f"""
DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN {_APP_FUNCTIONS} LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_catalog, pg_temp',
                       v_function, current_schema());
    END LOOP;
END
$$;
"""

UNPIN = f"""
DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN {_APP_FUNCTIONS} LOOP
        EXECUTE format('ALTER FUNCTION %s RESET search_path', v_function);
    END LOOP;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0014_retry_backoff")]

    operations = [
        migrations.RunSQL(sql=EXECUTOR_AUTHORITY, reverse_sql=REVERSE_EXECUTOR_AUTHORITY),
        migrations.RunSQL(sql=PIN, reverse_sql=UNPIN),
    ]
