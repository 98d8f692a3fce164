"""A sweep reclaims every unlocked expired lease, whatever other rows are locked."""

from __future__ import annotations

import pytest

from tests import factories
from tests.locks import expire_all
from tests.second_session import other
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery


def statuses(ids) -> set[str]:
    return set(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True))


def lock_rows(conn, ids) -> None:
    """Hold ``ids`` the way a holder inside ``holding()`` does, until ``conn`` ends."""
    conn.execute("SELECT id FROM workflow_agent_deliveries WHERE id = ANY(%s) FOR UPDATE", [ids])


@pytest.mark.django_db(transaction=True)
def test_locked_expired_rows_of_one_tenant_do_not_stall_the_sweep():
    stuck = factories.Step(targets=6)
    factories.committed(stuck)
    healthy = factories.Step(targets=1)
    factories.committed(healthy)
    held = expire_all(stuck)
    free = expire_all(healthy)
    with other() as conn:
        try:
            lock_rows(conn, held[:5])
            reclaimed = services.reap_expired_deliveries(batch_size=3, yield_ratio=0)
        finally:
            conn.rollback()
    assert reclaimed == 2
    assert statuses([held[5], *free]) == {"pending"}
    assert statuses(held[:5]) == {"claimed"}


@pytest.mark.django_db(transaction=True)
def test_one_stuck_row_in_each_of_batch_size_tenants_starves_no_one():
    stuck = [factories.Step(targets=1) for _ in range(3)]
    for step in stuck:
        factories.committed(step)
    healthy = factories.Step(targets=1)
    factories.committed(healthy)
    held = [expire_all(step)[0] for step in stuck]
    free = expire_all(healthy)
    with other() as conn:
        try:
            lock_rows(conn, held)
            reclaimed = services.reap_expired_deliveries(batch_size=3, yield_ratio=0)
        finally:
            conn.rollback()
    assert reclaimed == 1
    assert statuses(free) == {"pending"}
