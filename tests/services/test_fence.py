"""The community write fence of SPEC §4, proven on the database itself."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, transaction

from tests.support import factories
from tests.support.delivery_rows import COPY_DELIVERIES, counts, run_raw
from workflow_delivery import services
from workflow_delivery.exceptions import (
    CommunityWriteFenced,
    InvalidLifecycleTransition,
    IsolationLevelError,
    StaleFenceGeneration,
    UnexpectedCommunityState,
)
from workflow_delivery.models import (
    Community,
    Event,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from workflow_delivery.services import commit_deliveries

NOT_ACTIVE = ["quiescing", "fenced", "tombstone"]
TENANT_WRITES = {
    "workflows": "UPDATE workflows SET name = 'renamed' WHERE community_id = %s",
    "workflow_runs": "UPDATE workflow_runs SET status = 'running' WHERE community_id = %s",
    "events": "DELETE FROM events WHERE community_id = %s",
    "workflow_agent_deliveries": (
        "UPDATE workflow_agent_deliveries SET lease_generation = lease_generation + 1 "
        "WHERE community_id = %s"
    ),
}


def fenced_step(state: str) -> factories.Step:
    step = factories.Step(targets=2)
    commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    factories.move_to(step.community.id, state)
    return step


def refused(statement: str, params: list) -> DatabaseError:
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute(statement, params)
    return caught.value


@pytest.mark.parametrize("state", NOT_ACTIVE)
@pytest.mark.parametrize("table", sorted(TENANT_WRITES))
def test_write_to_a_tenant_table_of_a_non_active_community_is_refused(db, state, table):
    step = fenced_step(state)
    error = refused(TENANT_WRITES[table], [step.community.id])
    assert error.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert str(step.community.id) in str(error)
    assert state in str(error)
    assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 2


@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_insert_into_a_non_active_community_is_refused(db, state):
    owner = factories.community()
    factories.move_to(owner.id, state)
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        factories.workflow(owner)
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert owner.host in str(caught.value)


@pytest.mark.parametrize("direction", ["into", "out of"])
def test_moving_a_row_across_a_fenced_community_is_refused(db, direction):
    healthy, frozen = factories.community(), factories.community()
    source, destination = (healthy, frozen) if direction == "into" else (frozen, healthy)
    flow = factories.workflow(source)
    factories.move_to(frozen.id, "fenced")
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("UPDATE workflows SET community_id = %s WHERE id = %s", [destination.id, flow.id])
    assert str(frozen.id) in str(caught.value)
    assert Workflow.objects.get(pk=flow.pk).community_id == source.id


def test_each_transition_bumps_the_fence_generation(db):
    owner = factories.community()
    assert services.transition_community(owner.id, "quiescing") == 1
    assert services.transition_community(owner.id, "fenced") == 2
    assert services.transition_community(owner.id, "tombstone") == 3
    owner.refresh_from_db()
    assert (owner.deletion_state, owner.deletion_fence_generation) == ("tombstone", 3)
    assert owner.deleted_at is not None


def test_executor_may_write_under_the_current_generation(db):
    step = fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with services.executor_writes(step.community.id, generation):
        WorkflowRun.objects.filter(community=step.community).update(status="cancelled")
    assert set(
        WorkflowRun.objects.filter(community=step.community).values_list("status", flat=True)
    ) == {"cancelled"}


def test_executor_authority_ends_with_its_block(db):
    step = fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with transaction.atomic():
        with services.executor_writes(step.community.id, generation):
            pass
        with pytest.raises(DatabaseError), transaction.atomic():
            WorkflowRun.objects.filter(community=step.community).update(status="cancelled")


def test_executor_with_a_stale_generation_is_refused(db):
    step = fenced_step("quiescing")
    stale = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    factories.move_to(step.community.id, "fenced")
    with pytest.raises(StaleFenceGeneration), services.executor_writes(step.community.id, stale):
        pytest.fail("a stale executor must not get to write")


def test_stale_generation_presented_by_raw_sql_is_refused(db):
    step = fenced_step("quiescing")
    stale = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    factories.move_to(step.community.id, "fenced")
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as c:
        c.execute(
            "SELECT set_config('workflow_delivery.executor_community', %s, true), "
            "set_config('workflow_delivery.executor_generation', %s, true)",
            [str(step.community.id), str(stale)],
        )
        c.execute("DELETE FROM events WHERE community_id = %s", [step.community.id])
    assert Event.objects.filter(community=step.community).exists()


def test_executor_purges_a_fenced_tenant(db):
    step = fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    deleted = services.purge_community(step.community.id, generation)
    assert deleted["workflow_agent_deliveries"] == 2
    assert deleted["events"] == 1
    assert not WorkflowAgentDelivery.objects.filter(community=step.community).exists()
    factories.move_to(step.community.id, "tombstone")


def test_tombstone_cannot_be_reverted(db):
    owner = factories.community()
    factories.move_to(owner.id, "tombstone")
    for state in ["active", "quiescing", "fenced"]:
        with pytest.raises(InvalidLifecycleTransition):
            services.transition_community(owner.id, state)
        with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
            c.execute("UPDATE communities SET deletion_state = %s WHERE id = %s", [state, owner.id])
        assert caught.value.__cause__.diag.constraint_name == "wd_community_tombstone_permanent"
    assert Community.objects.get(pk=owner.pk).deletion_state == "tombstone"


def test_tombstone_cannot_be_deleted(db):
    owner = factories.community()
    factories.move_to(owner.id, "tombstone")
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("DELETE FROM communities WHERE id = %s", [owner.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_tombstone_permanent"
    assert Community.objects.filter(pk=owner.pk).exists()


def test_fenced_community_cannot_go_back_to_active(db):
    owner = factories.community()
    factories.move_to(owner.id, "fenced")
    with pytest.raises(InvalidLifecycleTransition):
        services.transition_community(owner.id, "active")


def test_quiescing_community_can_be_reactivated(db):
    owner = factories.community()
    services.transition_community(owner.id, "quiescing")
    assert services.transition_community(owner.id, "active") == 2
    factories.workflow(owner)


def test_direct_state_update_still_takes_the_fence(db, raw):
    owner = factories.community()
    raw.execute("UPDATE communities SET deletion_state = 'quiescing' WHERE id = %s", [owner.id])
    owner.refresh_from_db()
    assert owner.deletion_fence_generation == 1


@pytest.mark.parametrize(
    ("state", "allowed"),
    [("active", True), ("quiescing", False), ("fenced", False), ("tombstone", False)],
)
def test_community_write_allowed_only_for_active(db, state, allowed):
    owner = factories.community()
    if state != "active":
        factories.move_to(owner.id, state)
    assert services.community_write_allowed(owner.id) is allowed


def test_community_write_allowed_is_false_for_an_unknown_community(db):
    assert services.community_write_allowed(uuid.uuid4()) is False


@pytest.mark.django_db(transaction=True)
def test_community_write_allowed_refuses_other_isolation_levels():
    owner = factories.community()
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        c.execute("SELECT community_write_allowed(%s)", [owner.id])
    assert "READ COMMITTED" in str(caught.value)


@pytest.mark.django_db(transaction=True)
def test_executor_refuses_other_isolation_levels():
    owner = factories.community()
    with pytest.raises(IsolationLevelError), transaction.atomic(), connection.cursor() as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        services.transition_community(owner.id, "quiescing")


def test_unknown_state_is_a_clear_error(db):
    owner = factories.community()
    with pytest.raises(ValueError, match="deletion_state"):
        services.transition_community(owner.id, "deleted")


def test_every_tenant_table_carries_the_fence_trigger(db, raw):
    """Fence parity: a table with a community_id column and no fence trigger fails here.
    UPDATE and DELETE are fenced row by row (BEFORE, ROW); INSERT by the same row
    trigger, or (migration 0010) by a statement trigger over the new rows."""
    raw.execute(
        """
        WITH fenced AS (
            SELECT t.tgrelid,
                   bool_or(p.proname = 'wd_enforce_community_write_fence'
                           AND (t.tgtype & 1) = 1 AND (t.tgtype & 2) = 2
                           AND (t.tgtype & 8) = 8 AND (t.tgtype & 16) = 16) AS rows_fenced,
                   bool_or((p.proname = 'wd_enforce_community_write_fence'
                            AND (t.tgtype & 1) = 1 AND (t.tgtype & 2) = 2 AND (t.tgtype & 4) = 4)
                           OR (p.proname = 'wd_enforce_community_write_fence_on_insert'
                               AND (t.tgtype & 1) = 0 AND (t.tgtype & 4) = 4
                               AND t.tgnewtable IS NOT NULL)) AS inserts_fenced
              FROM pg_trigger t
              JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE NOT t.tgisinternal AND t.tgenabled <> 'D'
             GROUP BY t.tgrelid
        )
        SELECT c.relname
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'community_id'
                             AND NOT a.attisdropped
          LEFT JOIN fenced f ON f.tgrelid = c.oid
         WHERE c.relkind IN ('r', 'p') AND n.nspname = current_schema()
           AND NOT (coalesce(f.rows_fenced, false) AND coalesce(f.inserts_fenced, false))
        """
    )
    assert raw.fetchall() == []
    raw.execute(
        """
        SELECT count(*) FROM pg_trigger
         WHERE tgname = 'wd_community_write_fence' AND NOT tgisinternal
        """
    )
    assert raw.fetchone()[0] >= 4


def test_fence_parity_catches_a_tenant_table_without_the_trigger(db, raw):
    raw.execute("CREATE TABLE wd_probe_tenant (community_id uuid)")
    test_parity = test_every_tenant_table_carries_the_fence_trigger
    with pytest.raises(AssertionError):
        test_parity(db, raw)


def test_executor_block_that_fails_writes_nothing_and_keeps_no_authority(db):
    step = fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with transaction.atomic():
        with pytest.raises(RuntimeError), services.executor_writes(step.community.id, generation):
            WorkflowRun.objects.filter(community=step.community).update(status="cancelled")
            raise RuntimeError("executor crashed")
        assert set(
            WorkflowRun.objects.filter(community=step.community).values_list("status", flat=True)
        ) == {"pending"}
        with pytest.raises(DatabaseError), transaction.atomic():
            WorkflowRun.objects.filter(community=step.community).update(status="cancelled")


def test_fence_parity_catches_a_tenant_table_whose_inserts_are_not_fenced(db, raw):
    raw.execute("CREATE TABLE wd_probe_tenant (community_id uuid)")
    raw.execute(
        "CREATE TRIGGER wd_community_write_fence BEFORE UPDATE OR DELETE ON wd_probe_tenant "
        "FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence()"
    )
    with pytest.raises(AssertionError, match="wd_probe_tenant"):
        test_every_tenant_table_carries_the_fence_trigger(db, raw)
    raw.execute(
        "CREATE TRIGGER wd_community_write_fence_insert AFTER INSERT ON wd_probe_tenant "
        "REFERENCING NEW TABLE AS written FOR EACH STATEMENT "
        "EXECUTE FUNCTION wd_enforce_community_write_fence_on_insert()"
    )
    test_every_tenant_table_carries_the_fence_trigger(db, raw)


def present(cursor, community: Community, *, local: bool) -> None:
    cursor.execute(
        "SELECT set_config('workflow_delivery.executor_community', %s, %s), "
        "set_config('workflow_delivery.executor_generation', %s, %s)",
        [str(community.id), local, str(community.deletion_fence_generation), local],
    )


def test_executor_settings_without_the_exclusive_lock_authorise_nothing(transactional_db):
    step = factories.Step(targets=1)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    frozen = Community.objects.get(pk=step.community.pk)
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        present(c, frozen, local=True)
        c.execute("DELETE FROM workflow_agent_deliveries WHERE community_id = %s", [frozen.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert WorkflowAgentDelivery.objects.filter(community=frozen).count() == 1


@pytest.mark.django_db(transaction=True)
def test_executor_settings_left_on_the_session_authorise_nothing_in_the_next_transaction():
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    frozen = Community.objects.get(pk=step.community.pk)
    try:
        with transaction.atomic(), connection.cursor() as c:
            # A real executor's transaction, but presenting session-wide.
            c.execute("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [frozen.id])
            c.execute(
                "SELECT wd_present_executor(%s, %s)", [frozen.id, frozen.deletion_fence_generation]
            )
            present(c, frozen, local=False)
            c.execute(
                "DELETE FROM workflow_agent_deliveries "
                "WHERE community_id = %s AND target_pubkey = %s",
                [frozen.id, step.targets[0]],
            )
        # Next transaction on the same (pooled) connection: the settings are still
        # there, the lock is gone.
        with (
            pytest.raises(DatabaseError) as caught,
            transaction.atomic(),
            connection.cursor() as c,
        ):
            c.execute("SELECT current_setting('workflow_delivery.executor_community')")
            assert c.fetchone()[0] == str(frozen.id)
            c.execute("DELETE FROM workflow_agent_deliveries WHERE community_id = %s", [frozen.id])
        assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    finally:
        with connection.cursor() as c:
            c.execute("RESET workflow_delivery.executor_community")
            c.execute("RESET workflow_delivery.executor_generation")
    assert WorkflowAgentDelivery.objects.filter(community=frozen).count() == 1


@pytest.mark.parametrize(
    ("path", "target"),
    [(["active"], "fenced"), (["active"], "tombstone"), (["quiescing"], "tombstone")],
)
def test_a_lifecycle_step_cannot_be_skipped(db, raw, path, target):
    owner = factories.community()
    factories.move_to(owner.id, path[-1])
    before = Community.objects.get(pk=owner.pk)
    with pytest.raises(InvalidLifecycleTransition):
        services.transition_community(owner.id, target)
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("UPDATE communities SET deletion_state = %s WHERE id = %s", [target, owner.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_lifecycle_forward"
    after = Community.objects.get(pk=owner.pk)
    assert (after.deletion_state, after.deletion_fence_generation) == (
        before.deletion_state,
        before.deletion_fence_generation,
    )


def test_a_transition_from_a_state_the_caller_did_not_read_is_refused(db):
    owner = factories.community()
    services.transition_community(owner.id, "quiescing")
    services.transition_community(owner.id, "active")  # cancelled meanwhile
    with pytest.raises(UnexpectedCommunityState, match="is active, not quiescing"):
        services.transition_community(owner.id, "quiescing", expected="quiescing")
    assert Community.objects.get(pk=owner.pk).deletion_state == "active"
    assert services.transition_community(owner.id, "quiescing", expected="active") == 3


def test_a_fenced_write_names_its_community(db):
    step = factories.Step(targets=1)
    factories.move_to(step.community.id, "quiescing")
    with pytest.raises(CommunityWriteFenced) as caught:
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert caught.value.community_id == step.community.id


@pytest.mark.django_db(transaction=True)
def test_reversing_0006_restores_the_rules_of_0003():
    from django.core.management import call_command

    try:
        call_command("migrate", "workflow_delivery", "0005", verbosity=0)
        owner = factories.community()
        with connection.cursor() as c:
            # 0003's lifecycle: any forward move, a skipped step included.
            c.execute("UPDATE communities SET deletion_state = 'fenced' WHERE id = %s", [owner.id])
    finally:
        call_command("migrate", "workflow_delivery", verbosity=0)
    skipping = factories.community()
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as c:
        c.execute("UPDATE communities SET deletion_state = 'fenced' WHERE id = %s", [skipping.id])


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["quiescing", "fenced", "tombstone"])
def test_one_statement_writing_to_an_active_and_a_frozen_community_writes_nothing(state):
    healthy, frozen = factories.Step(targets=3), factories.Step(targets=2)
    factories.committed(healthy)
    factories.committed(frozen)
    factories.move_to(frozen.community.id, state)
    before = counts()
    with pytest.raises(DatabaseError) as caught:
        run_raw(COPY_DELIVERIES, [[str(healthy.community.id), str(frozen.community.id)]])
    error = caught.value.__cause__
    assert error.diag.constraint_name == "wd_community_write_fence"
    assert error.diag.table_name == "workflow_agent_deliveries"
    assert f"{frozen.community.id} ({frozen.community.host}) is {state}" in str(error)
    assert "INSERT on workflow_agent_deliveries" in str(error)
    assert counts() == before


@pytest.mark.django_db
def test_the_executor_of_a_fenced_community_may_still_insert():
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "quiescing")
    factories.move_to(step.community.id, "fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    before = counts()
    with services.executor_writes(step.community.id, generation), connection.cursor() as cursor:
        cursor.execute(COPY_DELIVERIES, [[str(step.community.id)]])
    assert counts() == (before[0] + 2, before[1])


@pytest.mark.django_db
def test_a_retry_into_a_frozen_community_is_refused_by_the_service():
    """Every row of the retry is skipped, so no row reaches the statement trigger: the
    producer's statement asks the fence itself."""
    step = factories.Step(targets=3)
    deliveries = factories.committed(step)
    factories.move_to(step.community.id, "quiescing")
    before = counts()
    with pytest.raises(CommunityWriteFenced, match=str(step.community.id)):
        services.commit_deliveries(step.community.id, step.created_at, deliveries)
    with (
        pytest.raises(CommunityWriteFenced),
        services.delivery_identity(step.community.id, step.run.id, step.step_id) as identity,
    ):
        assert identity.exists
        identity.commit(step.created_at, deliveries)
    assert counts() == before


@pytest.mark.django_db
def test_a_raw_insert_whose_every_row_is_skipped_writes_nothing_in_a_frozen_community():
    """A statement-level fence sees no row to refuse: such a statement succeeds, and
    it writes nothing."""
    step = factories.Step(targets=2)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    before = counts()
    skipped = COPY_DELIVERIES.replace("step_id || '-copy'", "step_id").replace(
        "gen_random_uuid()", "id"
    )
    assert run_raw(skipped + " ON CONFLICT DO NOTHING", [[str(step.community.id)]]) == 0
    assert counts() == before


PER_STATEMENT = [
    "wd_require_community_write",
    "wd_enforce_community_write_fence_on_insert",
]


NOT_FOR_INSERTS = ["wd_enforce_community_write_fence", "wd_record_delivery_departure"]


@pytest.mark.django_db
def test_a_large_step_runs_the_fence_once_per_statement_and_the_timeline_never():
    """The fence, counted by PostgreSQL's own function statistics for this
    transaction: no call per row, and none of the timeline's function."""
    step = factories.Step(targets=2000)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL track_functions = 'pl'")
        created = services.commit_deliveries(
            step.community.id, step.created_at, step.new_deliveries()
        )
        # PostgreSQL 14 may list a function this backend called in an earlier
        # transaction with 0 calls in this one: only the calls made here count.
        cursor.execute(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions"
            " WHERE funcname = ANY(%s) AND calls > 0",
            [PER_STATEMENT + NOT_FOR_INSERTS],
        )
        calls = dict(cursor.fetchall())
    assert len(created) == 2000
    # The service's statement asks the fence itself, and the deliveries' statement
    # trigger asks again.
    assert calls == {
        "wd_require_community_write": 2,
        "wd_enforce_community_write_fence_on_insert": 1,
    }
