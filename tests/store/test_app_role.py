"""The app needs no superuser and owns nothing: the whole life of a delivery and of a
community's deletion runs under a role granted DML only, and that role cannot step
around the triggers (TRUNCATE, session_replication_role, disabling a trigger).

The role is made by ``buzz_project.demo.app_role`` (the SQL of docs/howto/operations.md, ``manage.py
grant_app_role``, what ``scripts/run`` serves the demo as): the demo's commands run
under it too."""

from __future__ import annotations

import logging
import re
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from buzz_project.demo import app_role as app_roles
from tests.support import factories
from workflow_delivery import errors, services
from workflow_delivery.exceptions import ExecutorNotAuthorized, TargetNotEnrolled
from workflow_delivery.models import Community, CommunityAgent, WorkflowAgentDelivery
from workflow_delivery.protocol import LeaseLost, NewDelivery, Outcome, Settled
from workflow_delivery.reaper import logger as reaper_logger

pytestmark = pytest.mark.django_db(transaction=True)

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "howto" / "operations.md"


def run(statement: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def fetch(statement: str, params=()) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall()


@contextmanager
def dropped_afterwards(kind: str) -> Iterator[str]:
    """A role name of this test alone; whatever it becomes is dropped afterwards."""
    role = f"h10_{kind}_{uuid.uuid4().hex[:8]}"
    try:
        yield role
    finally:
        connection.close()
        if fetch("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]):
            run(f"DROP OWNED BY {role}")
            run(f"DROP ROLE {role}")


@contextmanager
def as_role(role: str) -> Iterator[str]:
    """The test's connection (and every connection a thread of it opens) logs in as
    ``role`` inside the block."""
    owner = connection.settings_dict["USER"]
    connection.close()
    connection.settings_dict["USER"] = role
    try:
        yield role
    finally:
        connection.close()
        connection.settings_dict["USER"] = owner


@pytest.fixture
def new_role() -> Iterator[str]:
    with dropped_afterwards("app") as role:
        yield role


@pytest.fixture
def app_role(new_role) -> Iterator[str]:
    """A fresh login role made by the demo's grant_app_role, logged in as."""
    call_command("grant_app_role", new_role, stdout=StringIO())
    with as_role(new_role):
        yield new_role


@pytest.fixture
def executor_role() -> Iterator[str]:
    """A fresh role made by ``grant_app_role --executor`` (not logged in as; ask for it
    before ``app_role``, so the owner makes it)."""
    with dropped_afterwards("executor") as role:
        call_command("grant_app_role", role, "--executor", stdout=StringIO())
        yield role


def current_role() -> tuple[str, bool]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
        return cursor.fetchone()


def may_create_temporary_tables() -> bool:
    return fetch("SELECT has_database_privilege(current_database(), 'TEMPORARY')")[0][0]


def test_the_app_runs_its_whole_lifecycle_under_a_role_that_owns_nothing(executor_role, app_role):
    assert current_role() == (app_role, False)
    assert not may_create_temporary_tables()
    step = factories.Step(targets=2)
    created = services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert len(created) == 2
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    assert services.finish_delivery(lease, Outcome.FINISHED) == Settled(Outcome.FINISHED)
    other, _ = services.claim_delivery(step.community.id, step.targets[1], lease_seconds=1)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = statement_timestamp() "
            "- interval '1 second' WHERE id = %s",
            [other.delivery_id],
        )
    assert services.reap_expired_deliveries() == 1
    services.transition_community(step.community.id, "quiescing", expected="active")
    generation = services.transition_community(step.community.id, "fenced", expected="quiescing")
    # The purge is the executor role's: the app role may not present the executor.
    with pytest.raises(ExecutorNotAuthorized, match=f"role {app_role} may not act"):
        services.purge_community(step.community.id, generation)
    with as_role(executor_role):
        assert current_role() == (executor_role, False)
        assert not may_create_temporary_tables()
        deleted = services.purge_community(step.community.id, generation)
    assert deleted["workflow_agent_deliveries"] == 2
    services.transition_community(step.community.id, "tombstone", expected="fenced")
    assert Community.objects.get(pk=step.community.pk).deletion_state == "tombstone"


@pytest.mark.parametrize(
    "bypass",
    [
        "TRUNCATE workflow_agent_deliveries CASCADE",
        "SET session_replication_role = replica",
        "ALTER TABLE workflow_agent_deliveries DISABLE TRIGGER wd_community_write_fence",
        "DROP TRIGGER wd_community_write_fence ON workflow_agent_deliveries",
        "ALTER TABLE workflow_agent_deliveries DISABLE TRIGGER ALL",
        "CREATE TRIGGER wd_intruder BEFORE UPDATE ON workflow_agent_deliveries "
        "FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()",
        "DROP TABLE workflow_agent_deliveries CASCADE",
        "ALTER TABLE workflow_agent_deliveries DROP COLUMN lease_generation",
        "ALTER ROLE CURRENT_USER SUPERUSER",
        "ALTER ROLE CURRENT_USER BYPASSRLS",
    ],
)
def test_the_role_cannot_step_around_the_triggers(app_role, bypass):
    step = factories.Step(targets=1)
    factories.committed(step)
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run(bypass)
    assert errors.sqlstate(caught.value) == "42501"  # insufficient_privilege
    assert WorkflowAgentDelivery.objects.filter(run=step.run).count() == 1


# --- the agent roster: the app role runs it and cannot step around it -------------------


def test_the_app_role_enrolls_revokes_and_reinstates_and_is_held_to_the_roster(app_role):
    step = factories.Step(targets=1)
    lease_holder = factories.committed(step)[0]
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    stranger = factories.key32()
    with pytest.raises(TargetNotEnrolled):
        services.commit_deliveries(
            step.community.id,
            step.created_at,
            [NewDelivery(uuid.uuid4(), step.binding(stranger, step_id="other"))],
        )
    revocation = services.revoke_agent(step.community.id, step.targets[0], operator="ops")
    assert revocation.released == (lease_holder.id,)
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    assert services.reinstate_agent(step.community.id, step.targets[0]).enabled
    assert services.enroll_agent(step.community.id, stranger).enabled


@pytest.mark.parametrize(
    "bypass",
    [
        "ALTER TABLE workflow_agent_deliveries DISABLE TRIGGER wd_delivery_target_enrolled_insert",
        "DROP TRIGGER wd_delivery_target_enrolled_update ON workflow_agent_deliveries",
        "ALTER TABLE community_agents DISABLE TRIGGER wd_community_write_fence",
        "CREATE OR REPLACE FUNCTION wd_agent_standing(uuid, bytea) RETURNS text "
        "LANGUAGE sql AS $$ SELECT 'enabled' $$",
        "ALTER FUNCTION wd_require_enrolled(uuid, bytea[]) RESET search_path",
        "TRUNCATE community_agents CASCADE",
    ],
)
def test_the_role_cannot_step_around_the_roster(app_role, bypass):
    step = factories.Step(targets=1)
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run(bypass)
    assert errors.sqlstate(caught.value) == "42501"  # insufficient_privilege
    assert CommunityAgent.objects.filter(community=step.community, enabled=True).count() == 1
    with pytest.raises(TargetNotEnrolled):
        services.commit_deliveries(
            step.community.id,
            step.created_at,
            [NewDelivery(uuid.uuid4(), step.binding(factories.key32()))],
        )


# --- the fence holds against the app role ------------------------------------------------


@pytest.fixture
def app_role_with_temp(new_role) -> Iterator[str]:
    """An app role that may create temporary tables all the same (a database whose
    owner gave it TEMPORARY), logged in as."""
    call_command("grant_app_role", new_role, stdout=StringIO())
    database = connection.ops.quote_name(connection.settings_dict["NAME"])
    run(f"GRANT TEMPORARY ON DATABASE {database} TO {new_role}")
    with as_role(new_role):
        yield new_role


def a_fenced_step(state: str) -> factories.Step:
    step = factories.Step(targets=1)
    factories.committed(step)
    factories.move_to(step.community.id, state)
    return step


def tenant_rows(community_id) -> list[tuple]:
    return fetch(
        "SELECT (SELECT array_agg(status) FROM public.workflow_runs WHERE community_id = %s), "
        "(SELECT count(*) FROM public.workflow_agent_deliveries WHERE community_id = %s)",
        [community_id, community_id],
    )


def test_the_app_role_cannot_create_temporary_tables(app_role):
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run("CREATE TEMP TABLE communities (id uuid)")
    assert errors.sqlstate(caught.value) == "42501"


@pytest.mark.parametrize(
    "write",
    [
        "UPDATE workflow_runs SET status = 'cancelled' WHERE community_id = %s",
        "DELETE FROM workflow_agent_deliveries WHERE community_id = %s",
        "INSERT INTO workflow_runs SELECT (jsonb_populate_record(NULL::public.workflow_runs, "
        "to_jsonb(r) || jsonb_build_object('id', gen_random_uuid()))).* "
        "FROM public.workflow_runs r WHERE r.community_id = %s",
    ],
    ids=["update", "delete", "insert"],
)
def test_a_temporary_communities_table_does_not_open_the_fence(app_role_with_temp, write):
    """The fence's functions read the real communities, not a session's shadow of it."""
    step = a_fenced_step("quiescing")
    before = tenant_rows(step.community.id)
    run(
        "CREATE TEMP TABLE communities (id uuid, host text, deletion_state text, "
        "deletion_fence_generation bigint)"
    )
    run("INSERT INTO communities VALUES (%s, 'shadow.example', 'active', 0)", [step.community.id])
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run(write, [step.community.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert tenant_rows(step.community.id) == before


def test_a_temporary_timeline_table_swallows_no_entry(app_role_with_temp):
    step = factories.Step(targets=1)
    (delivery,) = factories.committed(step)
    run(
        "CREATE TEMP TABLE workflow_delivery_timeline "
        "(LIKE public.workflow_delivery_timeline INCLUDING DEFAULTS INCLUDING IDENTITY)"
    )
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    services.release_lease(lease)
    assert fetch("SELECT count(*) FROM pg_temp.workflow_delivery_timeline") == [(0,)]
    assert fetch(
        "SELECT kind FROM public.workflow_delivery_timeline WHERE delivery_id = %s ORDER BY id",
        [delivery.id],
    ) == [("claimed",), ("released",)]


def test_the_deletion_lock_and_the_executor_settings_authorise_nothing(app_role):
    step = a_fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [step.community.id])
        run(
            "SELECT set_config('workflow_delivery.executor_community', %s, true), "
            "set_config('workflow_delivery.executor_generation', %s, true)",
            [str(step.community.id), str(generation)],
        )
        run("DELETE FROM workflow_agent_deliveries WHERE community_id = %s", [step.community.id])
    assert caught.value.__cause__.diag.constraint_name == "wd_community_write_fence"
    assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 1


@pytest.mark.parametrize(
    "present",
    [
        "SELECT wd_present_executor(%s, %s)",
        "INSERT INTO wd_executor_presentations "
        "VALUES (pg_backend_pid(), pg_current_xact_id(), %s, %s)",
    ],
    ids=["function", "table"],
)
def test_the_app_role_cannot_present_the_executor(app_role, present):
    step = a_fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [step.community.id])
        run(present, [step.community.id, generation])
    assert errors.sqlstate(caught.value) == "42501"
    with pytest.raises(ExecutorNotAuthorized):
        services.purge_community(step.community.id, generation)
    assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 1


def test_a_role_granted_the_presentations_table_still_cannot_forge_one(new_role):
    call_command("grant_app_role", new_role, stdout=StringIO())
    run(f"GRANT ALL ON wd_executor_presentations TO {new_role}")
    step = a_fenced_step("fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    with as_role(new_role):
        with pytest.raises(DatabaseError) as caught, transaction.atomic():
            run("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [step.community.id])
            run(
                "INSERT INTO wd_executor_presentations "
                "VALUES (pg_backend_pid(), pg_current_xact_id(), %s, %s)",
                [step.community.id, generation],
            )
        assert caught.value.__cause__.diag.constraint_name == "wd_executor_presentation_by_owner"
        assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 1


def test_the_docs_show_the_statements_grant_app_role_runs():
    section = OPERATIONS.read_text().split("## Run under an unprivileged role", 1)[1]
    block = re.search(r"```sql\n(.*?)```", section, re.S).group(1)
    assert block == app_roles.readme_sql()


def privileges(role: str) -> set[str]:
    """The table privileges the role holds on any table of the app's schema."""
    kinds = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
    held = fetch(
        "SELECT DISTINCT kind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, "
        "unnest(%s::text[]) AS kind WHERE n.nspname = 'public' AND c.relkind = 'r' "
        "AND has_table_privilege(%s, c.oid, kind)",
        [list(kinds), role],
    )
    return {kind for (kind,) in held}


def test_grant_app_role_makes_a_role_with_dml_only_and_is_idempotent(new_role, monkeypatch):
    monkeypatch.setenv("APP_DATABASE_PASSWORD", "not-a-real-secret")
    first, second = StringIO(), StringIO()
    call_command("grant_app_role", new_role, stdout=first)
    call_command("grant_app_role", new_role, stdout=second)
    assert f"app role {new_role} created" in first.getvalue()
    assert f"app role {new_role} kept" in second.getvalue()
    attributes = fetch(
        "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolbypassrls, rolreplication, "
        "rolpassword IS NOT NULL FROM pg_authid WHERE rolname = %s",
        [new_role],
    )
    assert attributes == [(True, False, False, False, False, False, True)]
    assert privileges(new_role) == {"SELECT", "INSERT", "UPDATE", "DELETE"}
    # Every table and sequence, Django's own too: the demo's admin logs in with them;
    # all but the executor's presentations, on which it holds nothing.
    assert fetch(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'public' AND ((c.relkind = 'r' AND NOT has_table_privilege(%s, "
        "c.oid, 'SELECT, INSERT, UPDATE, DELETE')) OR (c.relkind = 'S' AND NOT "
        "has_sequence_privilege(%s, c.oid, 'USAGE')))",
        [new_role, new_role],
    ) == [("wd_executor_presentations",)]
    assert fetch(
        "SELECT has_any_column_privilege(%s, 'wd_executor_presentations', "
        "'SELECT, INSERT, UPDATE, REFERENCES'), has_table_privilege(%s, "
        "'wd_executor_presentations', 'DELETE, TRUNCATE, TRIGGER'), "
        "has_database_privilege(%s, current_database(), 'TEMPORARY')",
        [new_role] * 3,
    ) == [(False, False, False)]
    assert may_present_executor(new_role) is False


def may_present_executor(role: str) -> bool:
    return fetch(
        "SELECT has_function_privilege(%s, 'wd_present_executor(uuid, bigint)', 'EXECUTE')",
        [role],
    )[0][0]


def test_grant_app_role_gives_and_takes_back_the_executors_authority(new_role):
    out = StringIO()
    call_command("grant_app_role", new_role, "--executor", stdout=out)
    assert "(may act as the deletion executor)" in out.getvalue()
    assert may_present_executor(new_role) is True
    call_command("grant_app_role", new_role, stdout=StringIO())
    assert may_present_executor(new_role) is False


def test_grant_app_role_refuses_a_role_that_may_still_create_temporary_tables(new_role):
    """TEMPORARY granted by another grantor, which the owner's REVOKE leaves in place."""
    call_command("grant_app_role", new_role, stdout=StringIO())
    database = connection.ops.quote_name(connection.settings_dict["NAME"])
    with dropped_afterwards("grantor") as grantor:
        run(f"CREATE ROLE {grantor}")
        run(f"GRANT TEMPORARY ON DATABASE {database} TO {grantor} WITH GRANT OPTION")
        run(f"SET ROLE {grantor}")
        try:
            run(f"GRANT TEMPORARY ON DATABASE {database} TO {new_role}")
        finally:
            run("RESET ROLE")
        with pytest.raises(CommandError, match="may create temporary tables"):
            call_command("grant_app_role", new_role, stdout=StringIO())
        run(f"REVOKE TEMPORARY ON DATABASE {database} FROM {grantor} CASCADE")


def may_create_in_public(role: str) -> bool:
    return fetch("SELECT has_schema_privilege(%s, 'public', 'CREATE')", [role])[0][0]


def test_a_function_planted_in_the_apps_schema_never_runs_as_the_owner(executor_role):
    """An executor role that may create in ``public`` (PUBLIC may, on a database made by
    PostgreSQL 14) plants ``public.pg_backend_pid()``, then presents itself: the owner's
    SECURITY DEFINER function runs the catalog's, never the planted one."""
    step = factories.Step(targets=1)
    factories.committed(step)
    factories.move_to(step.community.id, "fenced")
    generation = Community.objects.get(pk=step.community.pk).deletion_fence_generation
    run(f"GRANT CREATE ON SCHEMA public TO {executor_role}")
    with as_role(executor_role):
        run(
            "CREATE FUNCTION public.pg_backend_pid() RETURNS integer LANGUAGE plpgsql AS $$ "
            "BEGIN PERFORM pg_catalog.set_config('wd_test.planted_ran_as', current_user, false); "
            "RETURN pg_catalog.pg_backend_pid(); END $$"
        )
        with transaction.atomic():
            run("SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [step.community.id])
            run("SELECT wd_present_executor(%s, %s)", [step.community.id, generation])
            run("SELECT wd_withdraw_executor()")
        assert fetch("SELECT current_setting('wd_test.planted_ran_as', true)") == [(None,)]


def test_grant_app_role_takes_back_publics_create_on_the_apps_schema(new_role):
    """What a database made by PostgreSQL 14 grants; the role is made with it taken back."""
    run("GRANT CREATE ON SCHEMA public TO PUBLIC")
    try:
        call_command("grant_app_role", new_role, stdout=StringIO())
        assert may_create_in_public(new_role) is False
    finally:
        run("REVOKE CREATE ON SCHEMA public FROM PUBLIC")


def test_grant_app_role_refuses_a_role_that_may_still_create_in_the_apps_schema(new_role):
    """CREATE granted by another grantor, which the owner's REVOKE leaves in place."""
    call_command("grant_app_role", new_role, stdout=StringIO())
    with dropped_afterwards("grantor") as grantor:
        run(f"CREATE ROLE {grantor}")
        run(f"GRANT CREATE ON SCHEMA public TO {grantor} WITH GRANT OPTION")
        run(f"SET ROLE {grantor}")
        try:
            run(f"GRANT CREATE ON SCHEMA public TO {new_role}")
        finally:
            run("RESET ROLE")
        assert may_create_in_public(new_role) is True
        with pytest.raises(CommandError, match="may create in schema public"):
            call_command("grant_app_role", new_role, stdout=StringIO())
        run(f"REVOKE CREATE ON SCHEMA public FROM {grantor} CASCADE")


def test_grant_app_role_takes_a_role_back_to_its_attributes(new_role):
    run(f"CREATE ROLE {new_role} NOLOGIN CREATEDB CREATEROLE")
    call_command("grant_app_role", new_role, stdout=StringIO())
    assert fetch(
        "SELECT rolcanlogin, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = %s",
        [new_role],
    ) == [(True, False, False)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("GRANT TRUNCATE ON workflow_agent_deliveries TO {role}", "holds TRUNCATE"),
        ("GRANT {owner} TO {role}", "member of"),
        ("CREATE TABLE wd_app_owned (id int); ALTER TABLE wd_app_owned OWNER TO {role}", "owns"),
    ],
)
def test_grant_app_role_refuses_a_role_that_holds_more(new_role, extra, message):
    call_command("grant_app_role", new_role, stdout=StringIO())
    owner = connection.settings_dict["USER"]
    run(extra.format(role=new_role, owner=connection.ops.quote_name(owner)))
    with pytest.raises(CommandError, match=f"{new_role} is not an unprivileged role: {message}"):
        call_command("grant_app_role", new_role, stdout=StringIO())


def test_grant_app_role_refuses_the_owner_itself():
    owner = connection.settings_dict["USER"]
    with pytest.raises(CommandError, match="run this as the owner"):
        call_command("grant_app_role", owner, stdout=StringIO())


class _Sweeps(logging.Handler):
    """Calls ``callback`` on each sweep line the reaper logs."""

    def __init__(self, callback) -> None:
        super().__init__()
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("sweep="):
            self.callback()


@pytest.mark.psycopg3  # the agent API's wait listens with psycopg 3
def test_the_demo_runs_under_the_app_role(app_role, monkeypatch):
    """What scripts/run does after migrating, under the role it serves as: the demo
    data and the admin login, the simulated consumers, then serve_demo (the admin, the
    reaper loop and the HTTP agents), every session of it the role's."""
    monkeypatch.setenv("DEMO_ADMIN_PASSWORD", "demo-password")
    out = StringIO()
    call_command("demo_deliveries", "--superuser", "admin", stdout=out)
    assert "superuser admin created" in out.getvalue()
    assert "108 deliveries new" in out.getvalue()
    call_command("demo_deliveries", "--agents", "2", "--seconds", "0.5", stdout=out, verbosity=0)
    assert "agents done: claimed " in out.getvalue()
    assert "errors" not in out.getvalue().split("agents done: ")[1]

    served, seen, pages = StringIO(), set(), []

    def visit_then_stop() -> None:
        port = re.search(r"http://127\.0\.0\.1:(\d+)/admin/", served.getvalue()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/") as page:
            pages.append(page.status)
        seen.update(
            name
            for (name,) in fetch(
                "SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = current_database()"
            )
        )
        if len(pages) >= 3:
            signal.raise_signal(signal.SIGTERM)

    sweeps = _Sweeps(visit_then_stop)
    reaper_logger.addHandler(sweeps)
    try:
        call_command("serve_demo", "127.0.0.1:0", "--interval", "0.3", stdout=served)
    finally:
        reaper_logger.removeHandler(sweeps)
    assert pages == [200, 200, 200]
    assert seen == {app_role}
    assert "reaper stopped by SIGTERM: 3 sweeps (0 failed)" in served.getvalue()
    assert "http_errors" not in served.getvalue()
