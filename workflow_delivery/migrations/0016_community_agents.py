"""The community's agent roster: the keys a delivery may be committed to and the agent
API serves.

* ``community_agents``: one row per (community, pubkey), ``enabled`` until revoked
  (``revoked_at`` set if and only if it is not). A tenant table like the others: it
  references its community (RESTRICT), carries the community write fence, and
  ``purge_community`` deletes its rows. Every target of the deliveries already stored
  is enrolled, enabled, so producers and agents of an existing install keep working.
* ``wd_require_enrolled(community, targets)``: raises ``wd_delivery_target_enrolled``
  (SQLSTATE 23503, an integrity error) naming each target that is not an enabled
  agent of the community, unknown or revoked. It first takes the community's deletion
  lock and then its roster lock, both shared, so a revocation (which takes the roster
  lock exclusively) waits for every commit already past the check, and a commit after
  it sees it.
* ``wd_delivery_target_enrolled_insert``: an AFTER INSERT statement trigger on the
  delivery table that asks it once per community among the statement's new rows (a
  transition table, as the fence's insert check of migration 0010). A statement that
  creates no row (a producer's retry, every row skipped by ``ON CONFLICT``) asks
  nothing. ``wd_delivery_target_enrolled_update``: a row trigger for an UPDATE that
  changes a row's target, which claims and settles never do.
* ``wd_agent_standing(community, pubkey)``: ``'enabled'``, ``'revoked'`` or NULL
  (not in the roster), read after the same two shared locks, for the API's admission
  statement: a request admitted holds them until its transaction ends, so a
  revocation waits for the requests of the key in flight and then releases their
  leases.

The functions name their tables and the functions they call with the schema the app
is migrated into and pin ``search_path`` to it, ``pg_catalog`` and ``pg_temp``, as
every function of the app does (migration 0015).
"""

import django.contrib.postgres.functions
import django.db.models.deletion
import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

TABLE = "community_agents"

CONSTRAINTS = f"""
ALTER TABLE {TABLE} ADD CONSTRAINT wd_agent_community_fk
    FOREIGN KEY (community_id) REFERENCES communities (id) ON DELETE RESTRICT;
"""

REVERSE_CONSTRAINTS = f"ALTER TABLE {TABLE} DROP CONSTRAINT wd_agent_community_fk;"

# Before the fence trigger exists: the targets of a tenant being deleted are enrolled
# too, so a deletion cancelled later finds its agents where they were.
ENROLL_EXISTING_TARGETS = f"""
INSERT INTO {TABLE} (community_id, pubkey)
SELECT DISTINCT community_id, target_pubkey FROM workflow_agent_deliveries;
"""

FENCE = f"""
CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE ON {TABLE}
    FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();
"""

REVERSE_FENCE = f"DROP TRIGGER wd_community_write_fence ON {TABLE};"

# {s} is the app's schema, quoted.
FUNCTIONS = r"""
CREATE FUNCTION {s}.wd_community_roster_key(p_community_id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = {s}, pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.hashtextextended(
        'workflow_delivery.community_roster:' || p_community_id::text, 0)
$$;

CREATE FUNCTION {s}.wd_lock_roster_shared(p_community_id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = {s}, pg_catalog, pg_temp
AS $$
BEGIN
    -- The deletion lock first, as every writer takes it (the fence), then the
    -- roster's: one order everywhere, so a revocation and the deletion executor
    -- never wait on each other through a writer.
    PERFORM {s}.wd_require_read_committed();
    PERFORM pg_catalog.pg_advisory_xact_lock_shared({s}.wd_community_deletion_key(p_community_id));
    PERFORM pg_catalog.pg_advisory_xact_lock_shared({s}.wd_community_roster_key(p_community_id));
END
$$;

CREATE FUNCTION {s}.wd_first_keys(p_keys text[]) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = {s}, pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p_keys IS NULL THEN 'none'
        WHEN pg_catalog.cardinality(p_keys) <= 5 THEN pg_catalog.array_to_string(p_keys, ', ')
        ELSE pg_catalog.array_to_string(p_keys[1:5], ', ')
             || pg_catalog.format(' and %s more', pg_catalog.cardinality(p_keys) - 5)
    END
$$;

CREATE FUNCTION {s}.wd_require_enrolled(p_community_id uuid, p_targets bytea[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = {s}, pg_catalog, pg_temp
AS $$
DECLARE
    v_unknown text[];
    v_revoked text[];
BEGIN
    IF p_community_id IS NULL THEN
        RETURN;
    END IF;
    PERFORM {s}.wd_lock_roster_shared(p_community_id);
    -- A fresh snapshot, taken after the locks: a revocation that committed while we
    -- waited is seen.
    SELECT pg_catalog.array_agg(pg_catalog.encode(t.pubkey, 'hex') ORDER BY t.pubkey)
               FILTER (WHERE a.id IS NULL),
           pg_catalog.array_agg(pg_catalog.encode(t.pubkey, 'hex') ORDER BY t.pubkey)
               FILTER (WHERE a.id IS NOT NULL)
      INTO v_unknown, v_revoked
      FROM (SELECT DISTINCT u.pubkey FROM pg_catalog.unnest(p_targets) AS u (pubkey)) AS t
      LEFT JOIN {s}.community_agents AS a
        ON a.community_id = p_community_id AND a.pubkey = t.pubkey
     WHERE a.id IS NULL OR NOT a.enabled;
    IF v_unknown IS NULL AND v_revoked IS NULL THEN
        RETURN;
    END IF;
    -- The message names the first few of each; DETAIL names them all.
    RAISE EXCEPTION 'community %: a delivery''s target must be an enabled agent of its roster (not enrolled: %; revoked: %)',
        p_community_id, {s}.wd_first_keys(v_unknown), {s}.wd_first_keys(v_revoked)
        USING ERRCODE = 'foreign_key_violation',
              CONSTRAINT = 'wd_delivery_target_enrolled',
              TABLE = 'workflow_agent_deliveries',
              DETAIL = pg_catalog.format('community_id=%s unknown=%s revoked=%s', p_community_id,
                  coalesce(pg_catalog.array_to_string(v_unknown, ','), ''),
                  coalesce(pg_catalog.array_to_string(v_revoked, ','), ''));
END
$$;

CREATE FUNCTION {s}.wd_require_enrolled_targets() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {s}, pg_catalog, pg_temp
AS $$
DECLARE
    v_community uuid;
    v_targets bytea[];
BEGIN
    FOR v_community, v_targets IN
        SELECT community_id, pg_catalog.array_agg(target_pubkey)
          FROM created GROUP BY community_id ORDER BY community_id
    LOOP
        PERFORM {s}.wd_require_enrolled(v_community, v_targets);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE FUNCTION {s}.wd_require_enrolled_target() RETURNS trigger
LANGUAGE plpgsql
SET search_path = {s}, pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM {s}.wd_require_enrolled(NEW.community_id, ARRAY[NEW.target_pubkey]);
    RETURN NULL;
END
$$;

CREATE FUNCTION {s}.wd_agent_standing(p_community_id uuid, p_pubkey bytea) RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = {s}, pg_catalog, pg_temp
AS $$
BEGIN
    IF p_community_id IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM {s}.wd_lock_roster_shared(p_community_id);
    RETURN (
        SELECT CASE WHEN a.enabled THEN 'enabled' ELSE 'revoked' END
          FROM {s}.community_agents AS a
         WHERE a.community_id = p_community_id AND a.pubkey = p_pubkey
    );
END
$$;

CREATE TRIGGER wd_delivery_target_enrolled_insert
    AFTER INSERT ON {s}.workflow_agent_deliveries
    REFERENCING NEW TABLE AS created
    FOR EACH STATEMENT EXECUTE FUNCTION {s}.wd_require_enrolled_targets();

CREATE TRIGGER wd_delivery_target_enrolled_update
    AFTER UPDATE OF target_pubkey ON {s}.workflow_agent_deliveries
    FOR EACH ROW WHEN (NEW.target_pubkey IS DISTINCT FROM OLD.target_pubkey)
    EXECUTE FUNCTION {s}.wd_require_enrolled_target();
"""

REVERSE_FUNCTIONS = r"""
DROP TRIGGER wd_delivery_target_enrolled_update ON {s}.workflow_agent_deliveries;
DROP TRIGGER wd_delivery_target_enrolled_insert ON {s}.workflow_agent_deliveries;
DROP FUNCTION {s}.wd_agent_standing(uuid, bytea);
DROP FUNCTION {s}.wd_require_enrolled_target();
DROP FUNCTION {s}.wd_require_enrolled_targets();
DROP FUNCTION {s}.wd_require_enrolled(uuid, bytea[]);
DROP FUNCTION {s}.wd_first_keys(text[]);
DROP FUNCTION {s}.wd_lock_roster_shared(uuid);
DROP FUNCTION {s}.wd_community_roster_key(uuid);
"""


def _in_schema(statements: str):
    """Run ``statements`` with ``{s}`` as the quoted schema the app is migrated into."""

    def run(apps, schema_editor):
        connection = schema_editor.connection
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_schema()")
            schema = connection.ops.quote_name(cursor.fetchone()[0])
        schema_editor.execute(statements.replace("{s}", schema), params=None)

    return run


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0015_pin_function_search_path")]

    operations = [
        migrations.CreateModel(
            name="CommunityAgent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("pubkey", models.BinaryField()),
                ("label", models.TextField(blank=True, db_default="", default="")),
                ("enabled", models.BooleanField(db_default=True, default=True)),
                (
                    "added_at",
                    models.DateTimeField(
                        db_default=django.contrib.postgres.functions.TransactionNow(),
                        editable=False,
                    ),
                ),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                (
                    "community",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="agents",
                        to="workflow_delivery.community",
                    ),
                ),
            ],
            options={
                "verbose_name": "community agent",
                "db_table": TABLE,
                "ordering": ["community_id", "added_at", "id"],
                "permissions": [
                    ("revoke_agent", "Can revoke an agent of a community roster"),
                    ("reinstate_agent", "Can reinstate a revoked agent of a community roster"),
                ],
                "constraints": [
                    models.UniqueConstraint(fields=("community", "pubkey"), name="wd_agent_key"),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("pubkey"), 32
                        ),
                        name="wd_agent_pubkey_32_bytes",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("enabled", True), ("revoked_at__isnull", True)),
                            models.Q(("enabled", False), ("revoked_at__isnull", False)),
                            _connector="OR",
                        ),
                        name="wd_agent_revoked_at_iff_disabled",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("label__isnull", True),
                            django.db.models.lookups.LessThanOrEqual(
                                django.db.models.functions.text.Length("label"), 200
                            ),
                            _connector="OR",
                        ),
                        name="wd_agent_label_length",
                    ),
                ],
            },
        ),
        migrations.RunSQL(sql=CONSTRAINTS, reverse_sql=REVERSE_CONSTRAINTS),
        migrations.RunSQL(sql=ENROLL_EXISTING_TARGETS, reverse_sql=migrations.RunSQL.noop),
        migrations.RunSQL(sql=FENCE, reverse_sql=REVERSE_FENCE),
        migrations.RunPython(_in_schema(FUNCTIONS), _in_schema(REVERSE_FUNCTIONS)),
    ]
