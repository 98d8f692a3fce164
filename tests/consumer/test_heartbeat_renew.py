"""The heartbeat's renew (``services.holder.renew_waiting_at_most``): one prepared
statement in autocommit, one round trip, that renews a live lease, loses a lost one,
and waits for a lock (the row, the community's deletion lock) no longer than its own
lock_timeout, which ends with the statement."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import pytest
from django.db import connection
from django.test import override_settings

from tests.support import factories
from tests.support.locks import key_of
from tests.support.second_session import other
from workflow_delivery import services
from workflow_delivery.exceptions import DeliveryTimeout, ProtocolError
from workflow_delivery.protocol import LeaseLost, Outcome, Renewed
from workflow_delivery.services.holder import renew_waiting_at_most
from workflow_delivery.store import statements

pytestmark = pytest.mark.psycopg3


def renew(lease, lock_timeout_ms: int = 100):
    return renew_waiting_at_most(lease, lease_seconds=30, lock_timeout_ms=lock_timeout_ms)


def session_lock_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return cursor.fetchone()[0]


def messages_sent(action: Callable[[], object]) -> list[str]:
    """The protocol messages this session sends its server while ``action`` runs, by
    kind (Parse, Bind, Execute, Sync, Query …), from libpq's trace."""
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile() as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(1)  # no timestamps: direction, length, kind, …
        try:
            action()
        finally:
            pgconn.untrace()
        trace.seek(0)
        lines = trace.read().decode().splitlines()
    return [line.split("\t")[2] for line in lines if line.startswith("F\t")]


def test_a_live_lease_is_renewed_and_a_lost_one_is_not(transactional_db):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=5)
    renewed = renew(lease)
    assert isinstance(renewed, Renewed) and renewed.lease_until > lease.lease_until
    assert services.finish_delivery(lease, Outcome.FINISHED) is not None
    assert renew(lease) == LeaseLost()


def test_a_bad_lock_timeout_is_refused(transactional_db):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    for bad in (0, -5, 1.5, "100"):
        with pytest.raises(ProtocolError) as caught:
            renew(lease, bad)
        assert caught.value.field == "lock_timeout_ms"


@pytest.mark.parametrize("prepared", [True, False])
def test_one_renew_is_one_statement_in_one_round_trip(lock_timeout, prepared):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared):
        renew(lease)  # prepared on this session, when it is
        sent = messages_sent(lambda: renew(lease))
    # No BEGIN, SET, SAVEPOINT or COMMIT around it.
    if prepared:
        # Bound to the prepared statement and run.
        assert sent.count("Bind") == 1 and sent.count("Sync") == 1, sent
        assert "Query" not in sent and "Parse" not in sent, sent
    else:
        # Django's cursor binds on the client: one simple query.
        assert sent == ["Query"], sent


def test_a_held_row_times_out_and_the_timeout_ends_with_the_statement(lock_timeout):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    before = session_lock_timeout()
    with other() as holder:
        holder.execute(
            "SELECT 1 FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE", [lease.delivery_id]
        )
        with pytest.raises(DeliveryTimeout) as caught:
            renew(lease)
        holder.rollback()
    assert caught.value.sqlstate == "55P03"
    assert session_lock_timeout() == before
    assert isinstance(renew(lease), Renewed)


def test_the_deletion_lock_is_waited_for_no_longer_than_the_row(lock_timeout):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    key = key_of(step.community.id)
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key])
        with pytest.raises(DeliveryTimeout):
            renew(lease)
        executor.rollback()
    assert isinstance(renew(lease), Renewed)


def test_the_timeout_is_set_before_the_scan_takes_any_lock(transactional_db):
    """The setting's subquery is a one-time filter: evaluated once, before the scan,
    so before the deletion lock in the scan's filter and the row's lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (COSTS OFF) " + statements.HEARTBEAT_RENEW.sql,
            statements.HEARTBEAT_RENEW.args(
                {
                    "lease_seconds": 30,
                    "community_id": factories.Step(targets=1).community.id,
                    "delivery_id": "00000000-0000-0000-0000-000000000000",
                    "target_pubkey": b"\x01" * 32,
                    "generation": 1,
                    "lock_timeout": "100ms",
                }
            ),
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "One-Time Filter" in plan, plan
