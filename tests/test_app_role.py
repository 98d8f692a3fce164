"""The app needs no superuser and owns nothing: the whole life of a delivery and of a
community's deletion runs under a role granted DML only, and that role cannot step
around the triggers (TRUNCATE, session_replication_role, disabling a trigger).

The role is made by ``buzz_project.demo.app_role`` (README's SQL, ``manage.py
grant_app_role``, what ``scripts/run`` serves the demo as): the demo's commands run
under it too."""

from __future__ import annotations

import logging
import re
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from buzz_project.demo import app_role as app_roles
from tests import factories
from workflow_delivery import errors, fence, services
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome, Settled
from workflow_delivery.runner import logger as reaper_logger

pytestmark = pytest.mark.django_db(transaction=True)

README = Path(__file__).resolve().parent.parent / "README.md"


def run(statement: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement)


def fetch(statement: str, params=()) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall()


@pytest.fixture
def new_role() -> Iterator[str]:
    """A role name of this test alone; whatever it becomes is dropped afterwards."""
    role = f"h10_app_{uuid.uuid4().hex[:8]}"
    yield role
    connection.close()
    if fetch("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]):
        run(f"DROP OWNED BY {role}")
        run(f"DROP ROLE {role}")


@pytest.fixture
def app_role(new_role) -> Iterator[str]:
    """A fresh login role made by the demo's grant_app_role; the test's connection
    (and every connection a thread of it opens) uses it."""
    call_command("grant_app_role", new_role, stdout=StringIO())
    owner = connection.settings_dict["USER"]
    connection.close()
    connection.settings_dict["USER"] = new_role
    try:
        yield new_role
    finally:
        connection.close()
        connection.settings_dict["USER"] = owner


def current_role() -> tuple[str, bool]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
        return cursor.fetchone()


def test_the_app_runs_its_whole_lifecycle_under_a_role_that_owns_nothing(app_role):
    assert current_role() == (app_role, False)
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
    fence.transition_community(step.community.id, "quiescing", expected="active")
    generation = fence.transition_community(step.community.id, "fenced", expected="quiescing")
    deleted = fence.purge_community(step.community.id, generation)
    assert deleted["workflow_agent_deliveries"] == 2
    fence.transition_community(step.community.id, "tombstone", expected="fenced")
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


def test_the_readme_shows_the_statements_grant_app_role_runs():
    section = README.read_text().split("### Running under an unprivileged role", 1)[1]
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
    # Every table and sequence, Django's own too: the demo's admin logs in with them.
    assert (
        fetch(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND ((c.relkind = 'r' AND NOT has_table_privilege(%s, "
            "c.oid, 'SELECT, INSERT, UPDATE, DELETE')) OR (c.relkind = 'S' AND NOT "
            "has_sequence_privilege(%s, c.oid, 'USAGE')))",
            [new_role, new_role],
        )
        == []
    )


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
