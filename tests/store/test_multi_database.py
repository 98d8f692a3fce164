"""Communities in several databases (h13-style scratch databases on the local server):
the router sends each community's rows to its database, the services take the alias,
and the reaper and pruning sweep every database holding the app's tables."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.test import override_settings

from tests.support import factories
from workflow_delivery import routing, services
from workflow_delivery.models import Community, Event, Workflow, WorkflowAgentDelivery, WorkflowRun
from workflow_delivery.protocol import MESSAGE_KIND, MESSAGE_V1_MARKER, EventCause

ALIASES = ("extra_a", "extra_b")


def scratch_name(alias: str) -> str:
    # Named after the test database, so parallel checkouts never share one.
    return f"{connection.settings_dict['NAME']}_{alias}"


@pytest.fixture
def two_databases(transactional_db) -> Iterator[dict[str, str]]:
    """Two more databases on the same server, migrated, with their aliases; dropped after."""
    with connection.cursor() as cursor:
        for alias in ALIASES:
            cursor.execute(f'DROP DATABASE IF EXISTS "{scratch_name(alias)}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{scratch_name(alias)}"')
    homes = {str(uuid.uuid4()): alias for alias in ALIASES}
    try:
        for alias in ALIASES:
            connections.settings[alias] = {
                **connections.settings["default"],
                "NAME": scratch_name(alias),
            }
            # Connected here, explicitly: the test case only lets through connections to
            # aliases it was told of, or ones already open.
            connections[alias].connect()
        with override_settings(
            DATABASE_ROUTERS=["workflow_delivery.routing.CommunityRouter"],
            WORKFLOW_DELIVERY_COMMUNITY_DATABASES=homes,
        ):
            for alias in ALIASES:
                call_command("migrate", database=alias, verbosity=0)
            yield homes
    finally:
        for alias in ALIASES:
            if alias in connections.settings:
                connections[alias].close()
                del connections[alias]
                del connections.settings[alias]
        with connection.cursor() as cursor:
            for alias in ALIASES:
                cursor.execute(f'DROP DATABASE IF EXISTS "{scratch_name(alias)}" WITH (FORCE)')


def tenant_step(community_id: str, alias: str) -> factories.Step:
    """A step whose rows are written where the router sends them: ``Model.save()``
    asks the router with the instance (a manager's ``create()`` would not)."""
    owner = Community(id=community_id, host=f"{alias}.example")
    owner.save()
    flow = Workflow(community=owner, name="triage", owner_pubkey=factories.key32())
    flow.save()
    run = WorkflowRun(community=owner, workflow=flow)
    run.save()
    step = object.__new__(factories.Step)
    step.community, step.workflow, step.run = owner, flow, run
    step.targets = [factories.key32()]
    step.message = Event(
        id=factories.key32(),
        community=owner,
        created_at=factories.whole_second_now(),
        kind=MESSAGE_KIND,
        pubkey=factories.key32(),
        tags=[["p", step.targets[0].hex(), "", MESSAGE_V1_MARKER]],
    )
    step.message.save()
    services.enroll_agents(owner.id, step.targets, using=alias)
    step.step_id, step.definition_event_id = "step-1", factories.key32()
    step.cause = EventCause(factories.key32())
    assert {row._state.db for row in (owner, flow, run, step.message)} == {alias}
    return step


def expired_lease(community_id: str, alias: str) -> uuid.UUID:
    step = tenant_step(community_id, alias)
    owner = step.community
    (created,) = services.commit_deliveries(
        owner.id, step.created_at, step.new_deliveries(), using=alias
    )
    assert services.claim_delivery(owner.id, step.targets[0], using=alias)
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 minute'"
        )
    return created


def test_each_community_lives_in_its_database_and_the_sweeps_visit_them_all(two_databases):
    ids = {alias: expired_lease(cid, alias) for cid, alias in two_databases.items()}
    for cid, alias in two_databases.items():
        assert routing.database_for_community(cid) == alias
        rows = WorkflowAgentDelivery.objects.using(alias)
        assert list(rows.values_list("id", flat=True)) == [ids[alias]]
        assert rows.filter(community_id=cid).count() == 1
    assert not WorkflowAgentDelivery.objects.using("default").exists()
    assert set(ALIASES) <= set(routing.app_databases())

    out = StringIO()
    call_command("reap_deliveries", "--all-databases", stdout=out)
    assert "reclaimed 2 expired leases" in out.getvalue()
    for alias, delivery_id in ids.items():
        assert WorkflowAgentDelivery.objects.using(alias).get(pk=delivery_id).status == "pending"

    for cid, alias in two_databases.items():
        target = WorkflowAgentDelivery.objects.using(alias).get().target_pubkey
        lease, _ = services.claim_delivery(cid, bytes(target), using=alias)
        services.finish_delivery(lease, "finished", using=alias)
    out = StringIO()
    call_command("prune_deliveries", "--older-than", "0s", "--all-databases", stdout=out)
    assert "pruned 2 terminal deliveries" in out.getvalue()
    assert not any(WorkflowAgentDelivery.objects.using(alias).exists() for alias in ALIASES)


def test_a_command_names_an_unknown_alias(two_databases):
    with pytest.raises(Exception, match="no database alias 'nowhere'"):
        call_command("reap_deliveries", "--database", "nowhere", stdout=StringIO())


def test_stats_read_one_named_database(two_databases):
    (cid, alias), _ = two_databases.items()
    expired_lease(cid, alias)
    out = StringIO()
    call_command("delivery_stats", "--database", alias, "--json", stdout=out)
    assert f'"host": "{alias}.example"' in out.getvalue()
