"""The community write fence (SPEC §4).

* ``wd_community_deletion_key(id)``: the advisory-lock key of a community's deletion.
* ``community_write_allowed(id)``: true only for an existing, active community; takes
  the shared deletion lock; never raises for a fenced tenant; refuses to run outside
  READ COMMITTED (a longer snapshot could not see the executor's commit).
* ``wd_community_write_fence``: a row trigger on every tenant table that refuses
  writes to a community that is not active, unless the deletion executor presents,
  transaction-locally, that community and its current fence generation.
* ``wd_community_lifecycle_guard``: a state change of a community takes the exclusive
  deletion lock (draining in-flight writers), bumps the fence generation, and can
  never leave a tombstone; a tombstone cannot be deleted.
"""

from django.db import migrations

TENANT_TABLES = ["workflows", "workflow_runs", "events", "workflow_agent_deliveries"]

FUNCTIONS = r"""
CREATE FUNCTION wd_community_deletion_key(p_community_id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtextextended('workflow_delivery.community_deletion:' || p_community_id::text, 0) $$;

CREATE FUNCTION wd_require_read_committed() RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'the community write fence needs READ COMMITTED isolation, this transaction runs at %',
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Run fenced statements in a READ COMMITTED transaction (the PostgreSQL default).';
    END IF;
END
$$;

CREATE FUNCTION community_write_allowed(p_community_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM wd_require_read_committed();
    PERFORM pg_advisory_xact_lock_shared(wd_community_deletion_key(p_community_id));
    RETURN EXISTS (
        SELECT 1 FROM communities WHERE id = p_community_id AND deletion_state = 'active'
    );
END
$$;

CREATE FUNCTION wd_enforce_community_write_fence() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_ids uuid[];
    v_id uuid;
    v_host text;
    v_state text;
    v_generation bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        v_ids := ARRAY[NEW.community_id];
    ELSIF TG_OP = 'DELETE' THEN
        v_ids := ARRAY[OLD.community_id];
    ELSIF NEW.community_id IS DISTINCT FROM OLD.community_id THEN
        v_ids := ARRAY[OLD.community_id, NEW.community_id];
    ELSE
        v_ids := ARRAY[NEW.community_id];
    END IF;
    FOREACH v_id IN ARRAY v_ids LOOP
        CONTINUE WHEN v_id IS NULL;
        PERFORM wd_require_read_committed();
        PERFORM pg_advisory_xact_lock_shared(wd_community_deletion_key(v_id));
        SELECT host, deletion_state, deletion_fence_generation
          INTO v_host, v_state, v_generation
          FROM communities WHERE id = v_id;
        CONTINUE WHEN NOT FOUND OR v_state = 'active';
        IF current_setting('workflow_delivery.executor_community', true) IS NOT DISTINCT FROM v_id::text
           AND current_setting('workflow_delivery.executor_generation', true)
               IS NOT DISTINCT FROM v_generation::text THEN
            CONTINUE;
        END IF;
        RAISE EXCEPTION 'community % (%) is %: % on % refused by the community write fence',
            v_id, v_host, v_state, TG_OP, TG_TABLE_NAME
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  CONSTRAINT = 'wd_community_write_fence',
                  TABLE = TG_TABLE_NAME,
                  SCHEMA = TG_TABLE_SCHEMA,
                  DETAIL = format('community_id=%s deletion_state=%s', v_id, v_state);
    END LOOP;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION wd_guard_community_lifecycle() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_rank CONSTANT jsonb := '{"active": 0, "quiescing": 1, "fenced": 2, "tombstone": 3}';
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.deletion_state = 'tombstone' THEN
            RAISE EXCEPTION 'community % (%) is a tombstone: it cannot be deleted', OLD.id, OLD.host
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      CONSTRAINT = 'wd_community_tombstone_permanent', TABLE = TG_TABLE_NAME;
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.id IS DISTINCT FROM OLD.id THEN
        RAISE EXCEPTION 'community %: its id cannot change', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'wd_community_id_immutable',
                  TABLE = TG_TABLE_NAME;
    END IF;
    IF OLD.deletion_state = 'tombstone'
       AND (NEW.deletion_state, NEW.deleted_at) IS DISTINCT FROM (OLD.deletion_state, OLD.deleted_at) THEN
        RAISE EXCEPTION 'community % (%) is a tombstone: its state is permanent', OLD.id, OLD.host
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  CONSTRAINT = 'wd_community_tombstone_permanent', TABLE = TG_TABLE_NAME;
    END IF;
    -- (A negative value is left for wd_community_fence_generation_nonneg to report.)
    IF NEW.deletion_fence_generation < OLD.deletion_fence_generation
       AND NEW.deletion_fence_generation >= 0 THEN
        RAISE EXCEPTION 'community %: deletion_fence_generation cannot decrease (% -> %)',
            OLD.id, OLD.deletion_fence_generation, NEW.deletion_fence_generation
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_community_fence_generation_monotonic', TABLE = TG_TABLE_NAME;
    END IF;
    IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN
        IF NOT (v_rank ? NEW.deletion_state) THEN
            RETURN NEW;  -- wd_community_deletion_state_valid reports it
        END IF;
        IF (v_rank ->> NEW.deletion_state)::int < (v_rank ->> OLD.deletion_state)::int
           AND NOT (OLD.deletion_state = 'quiescing' AND NEW.deletion_state = 'active') THEN
            RAISE EXCEPTION 'community % (%): % -> % is not a lifecycle transition',
                OLD.id, OLD.host, OLD.deletion_state, NEW.deletion_state
                USING ERRCODE = 'check_violation',
                      CONSTRAINT = 'wd_community_lifecycle_forward', TABLE = TG_TABLE_NAME;
        END IF;
        -- The exclusive deletion lock waits for every writer that passed the fence
        -- (they hold the shared lock to commit) and holds new ones until we commit.
        PERFORM wd_require_read_committed();
        PERFORM pg_advisory_xact_lock(wd_community_deletion_key(OLD.id));
        IF NEW.deletion_fence_generation = OLD.deletion_fence_generation THEN
            NEW.deletion_fence_generation := OLD.deletion_fence_generation + 1;
        END IF;
        IF NEW.deletion_state = 'tombstone' AND NEW.deleted_at IS NULL THEN
            NEW.deleted_at := now();
        END IF;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER wd_community_lifecycle_guard
    BEFORE UPDATE OR DELETE ON communities
    FOR EACH ROW EXECUTE FUNCTION wd_guard_community_lifecycle();
"""

REVERSE_FUNCTIONS = """
DROP TRIGGER wd_community_lifecycle_guard ON communities;
DROP FUNCTION wd_guard_community_lifecycle();
DROP FUNCTION wd_enforce_community_write_fence();
DROP FUNCTION community_write_allowed(uuid);
DROP FUNCTION wd_require_read_committed();
DROP FUNCTION wd_community_deletion_key(uuid);
"""


def fence_trigger(table):
    return migrations.RunSQL(
        sql=(
            f"CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE "
            f"ON {table} FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();"
        ),
        reverse_sql=f"DROP TRIGGER wd_community_write_fence ON {table};",
    )


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0002_tenant_foreign_keys")]

    operations = [
        migrations.RunSQL(sql=FUNCTIONS, reverse_sql=REVERSE_FUNCTIONS),
        *[fence_trigger(table) for table in TENANT_TABLES],
    ]
