"""Hardening of the fence, the lifecycle, a step's message and the reaper's index.

* The write fence accepts the deletion executor's presentation only in a transaction
  whose backend holds that community's *exclusive* deletion lock (asked of
  ``pg_locks``), so settings presented without the lock, or left over on a pooled
  connection from an earlier transaction, authorise nothing.
* The lifecycle guard lets a community move only to its next state
  (``active → quiescing → fenced → tombstone``) or back from quiescing to active.
* ``wd_delivery_one_message_per_step``: every delivery of one (community, run, step)
  carries the same message event, so a second commit with another message is refused.
* The reaper's index leads with the community, so a sweep reads the expired rows of
  the communities it reclaims and never the rows parked in one that is not active.

Reversing restores migration 0003's functions and the old index.
"""

from django.db import migrations, models

EXECUTOR_LOCK = r"""
-- True when this backend holds the community's exclusive deletion lock. An advisory
-- lock on one bigint key shows in pg_locks with the key's high half as classid, its
-- low half as objid and objsubid 1.
CREATE FUNCTION wd_holds_community_deletion_lock(p_community_id uuid) RETURNS boolean
LANGUAGE sql VOLATILE
AS $$
    SELECT EXISTS (
        SELECT 1
          FROM pg_locks l
          CROSS JOIN (SELECT wd_community_deletion_key(p_community_id) AS k) key
         WHERE l.locktype = 'advisory'
           AND l.pid = pg_backend_pid()
           AND l.mode = 'ExclusiveLock'
           AND l.granted
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.objsubid = 1
           AND l.classid = ((key.k >> 32) & 4294967295)::oid
           AND l.objid = (key.k & 4294967295)::oid
    )
$$;

CREATE OR REPLACE FUNCTION wd_enforce_community_write_fence() RETURNS trigger
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
        -- The presentation names the executor; only the exclusive lock, held by this
        -- very transaction's backend, proves it is one (settings anyone can set).
        IF current_setting('workflow_delivery.executor_community', true) IS NOT DISTINCT FROM v_id::text
           AND current_setting('workflow_delivery.executor_generation', true)
               IS NOT DISTINCT FROM v_generation::text
           AND wd_holds_community_deletion_lock(v_id) THEN
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
"""

ONE_STEP_LIFECYCLE = r"""
CREATE OR REPLACE FUNCTION wd_guard_community_lifecycle() RETURNS trigger
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
        -- One step at a time: the next state, or a cancelled deletion back to active.
        IF (v_rank ->> NEW.deletion_state)::int <> (v_rank ->> OLD.deletion_state)::int + 1
           AND NOT (OLD.deletion_state = 'quiescing' AND NEW.deletion_state = 'active') THEN
            RAISE EXCEPTION 'community % (%): % -> % is not a lifecycle transition (one step at a time: active -> quiescing -> fenced -> tombstone, or quiescing -> active)',
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
"""

ONE_MESSAGE_PER_STEP = r"""
-- Every delivery of a step already carries one message (this trigger keeps it so),
-- so one row of the step is enough to compare with: an index probe per inserted row.
CREATE FUNCTION wd_enforce_one_message_per_step() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_message bytea;
BEGIN
    SELECT message_event_id INTO v_message
      FROM workflow_agent_deliveries
     WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND step_id = NEW.step_id
     LIMIT 1;
    IF FOUND AND v_message IS DISTINCT FROM NEW.message_event_id THEN
        RAISE EXCEPTION 'step % of run % already carries message %, not %: a step has one message',
            NEW.step_id, NEW.run_id, encode(v_message, 'hex'), encode(NEW.message_event_id, 'hex')
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'wd_delivery_one_message_per_step', TABLE = TG_TABLE_NAME;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER wd_delivery_one_message_per_step
    BEFORE INSERT ON workflow_agent_deliveries
    FOR EACH ROW EXECUTE FUNCTION wd_enforce_one_message_per_step();
"""

# On reverse: 0003's write fence again, and no lock test.
REVERSE_EXECUTOR_LOCK = """\
CREATE OR REPLACE FUNCTION wd_enforce_community_write_fence() RETURNS trigger
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
DROP FUNCTION wd_holds_community_deletion_lock(uuid);"""

# 0003's lifecycle guard, restored on reverse.
REVERSE_ONE_STEP_LIFECYCLE = """\
CREATE OR REPLACE FUNCTION wd_guard_community_lifecycle() RETURNS trigger
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
$$;"""

REVERSE_ONE_MESSAGE_PER_STEP = """
DROP TRIGGER wd_delivery_one_message_per_step ON workflow_agent_deliveries;
DROP FUNCTION wd_enforce_one_message_per_step();
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0005_delivery_operator_permissions")]

    operations = [
        migrations.RunSQL(
            sql=EXECUTOR_LOCK,
            reverse_sql=REVERSE_EXECUTOR_LOCK,
        ),
        migrations.RunSQL(
            sql=ONE_STEP_LIFECYCLE,
            reverse_sql=REVERSE_ONE_STEP_LIFECYCLE,
        ),
        migrations.RunSQL(sql=ONE_MESSAGE_PER_STEP, reverse_sql=REVERSE_ONE_MESSAGE_PER_STEP),
        migrations.RemoveIndex(model_name="workflowagentdelivery", name="wd_delivery_reap_idx"),
        migrations.AddIndex(
            model_name="workflowagentdelivery",
            index=models.Index(
                condition=models.Q(("status", "claimed")),
                fields=["community", "lease_until"],
                name="wd_delivery_reap_community_idx",
            ),
        ),
    ]
