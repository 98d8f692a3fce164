"""The app needs no superuser and owns nothing: the whole life of a delivery and of a
community's deletion runs under a role granted DML only, and that role cannot step
around the triggers (TRUNCATE, session_replication_role, disabling a trigger)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import DatabaseError, connection, transaction

from tests import factories
from workflow_delivery import errors, fence, services
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome, Settled

pytestmark = pytest.mark.django_db(transaction=True)

# What README "Running under an unprivileged role" tells an operator to grant.
GRANTS = """
GRANT CONNECT ON DATABASE {database} TO {role};
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role};
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role};
"""


def run(statement: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement)


@pytest.fixture
def app_role() -> Iterator[str]:
    """A fresh login role with DML grants only; the test's connection uses it."""
    role = f"h10_app_{uuid.uuid4().hex[:8]}"
    database = connection.settings_dict["NAME"]
    run(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS")
    run(GRANTS.format(database=connection.ops.quote_name(database), role=role))
    owner = connection.settings_dict["USER"]
    connection.close()
    connection.settings_dict["USER"] = role
    try:
        yield role
    finally:
        connection.close()
        connection.settings_dict["USER"] = owner
        run(f"DROP OWNED BY {role}")
        run(f"DROP ROLE {role}")


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
    ],
)
def test_the_role_cannot_step_around_the_triggers(app_role, bypass):
    step = factories.Step(targets=1)
    factories.committed(step)
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        run(bypass)
    assert errors.sqlstate(caught.value) == "42501"  # insufficient_privilege
    assert WorkflowAgentDelivery.objects.filter(run=step.run).count() == 1
