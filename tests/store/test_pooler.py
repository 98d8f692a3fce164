"""Behind PgBouncer in transaction pooling mode, which keeps no prepared statements per
client: one client's statement must never run under another client's name."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connection, connections
from django.db.backends.postgresql.base import DatabaseWrapper
from django.test import override_settings

from tests.support import factories
from tests.support.pgbouncer import pgbouncer, real_server
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.pooler]


@pytest.fixture
def bouncer() -> Iterator[dict]:
    # Two server connections: enough for two clients' statements to land apart.
    with pgbouncer(connection.settings_dict, pool_size=2) as settings:
        yield settings


@pytest.fixture
def through(bouncer: dict) -> Iterator:
    """Open Django connections, by alias, that reach the server through PgBouncer."""
    opened: list[str] = []

    def open_alias(alias: str, **options: object) -> DatabaseWrapper:
        settings = {**bouncer, "CONN_MAX_AGE": 0}
        settings["OPTIONS"] = {**settings.get("OPTIONS", {}), **options}
        wrapper = DatabaseWrapper(settings, alias=alias)
        connections[alias] = wrapper
        opened.append(alias)
        return wrapper

    yield open_alias
    for alias in opened:
        connections[alias].close()
        del connections[alias]


class Pin:
    """A client holding a transaction open, so PgBouncer keeps its server for it."""

    def __init__(self, wrapper: DatabaseWrapper) -> None:
        self.wrapper = wrapper
        wrapper.set_autocommit(False)

    def hold(self) -> int:
        with self.wrapper.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    def let_go(self) -> None:
        self.wrapper.commit()


def claimed_delivery(step: factories.Step) -> uuid.UUID:
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    return lease.delivery_id


# The host may bind server-side with psycopg preparing every statement (threshold 0)
# and turn the app's own preparing off: the app's statements still never run under a
# prepared name.
HOST_PREPARES = {"server_side_binding": True, "prepare_threshold": 0}
SETTINGS = [
    pytest.param({}, True, id="defaults"),
    pytest.param(HOST_PREPARES, False, id="host-prepares-everything", marks=pytest.mark.psycopg3),
]


@pytest.mark.parametrize(("options", "app_prepares"), SETTINGS)
def test_a_release_never_runs_another_clients_mark_failed(through, options, app_prepares):
    step = factories.Step(targets=1)
    delivery = claimed_delivery(step)
    community = step.community.id
    nothing = [uuid.uuid4()]
    first, second = Pin(through("pin_1")), Pin(through("pin_2"))
    through("client_a", **options), through("client_b", **options)
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=app_prepares):
        released = release_under_anothers_name(first, second, community, delivery, nothing)
    row = WorkflowAgentDelivery.objects.get(id=delivery)
    assert (released, row.status) == ([delivery], "pending")


def release_under_anothers_name(first: Pin, second: Pin, community, delivery, nothing) -> list:
    """Client A marks failed on one server, client B releases on the other, then B
    releases again on A's server: with shared prepared names that runs A's statement.
    """
    # Both server connections held; PgBouncer then gives each client the one let go.
    first_server, second_server = first.hold(), second.hold()
    assert first_server != second_server
    first.let_go()
    # Client A's first statement of the app, "mark failed", on the first server.
    assert services.fail_deliveries(community, nothing, using="client_a") == []
    assert first.hold() == first_server
    second.let_go()
    # Client B's "release", on the second server.
    assert services.release_deliveries(community, nothing, using="client_b") == []
    assert second.hold() == second_server
    first.let_go()
    # Client B releases again, now on the first server, where A's statements live.
    released = services.release_deliveries(community, [delivery], using="client_b")
    second.let_go()
    return released


def test_the_lifecycle_runs_through_the_pooler_with_statements_unprepared(through):
    step = factories.Step(targets=1)
    factories.committed(step)
    through("client_a")
    lease, _ = services.claim_delivery(step.community.id, step.targets[0], using="client_a")
    assert services.renew_delivery(lease, lease_seconds=2, using="client_a").lease_until
    settled = services.finish_delivery(lease, "finished", using="client_a")
    assert settled.outcome.value == "finished"
    with connections["client_a"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone()[0] == 0


@pytest.mark.psycopg3
def test_a_pooler_is_seen_and_a_direct_connection_is_not(through):
    from workflow_delivery.store import run as db

    direct = DatabaseWrapper(real_server(connection.settings_dict), alias="direct")
    try:
        direct.ensure_connection()
        session = db.Session()
        assert db._behind_pooler(direct, direct.connection, session, "direct") is False
        assert session.pooled is False
    finally:
        direct.close()
    pooled = through("client_c")
    pooled.ensure_connection()
    session = db.Session()
    assert db._behind_pooler(pooled, pooled.connection, session, "client_c") is True
    # Asked once: the answer is the session's.
    assert session.pooled is True
