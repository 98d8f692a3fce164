"""The operator's release and mark-failed (what the admin's actions and the commands call):
neither queues behind a tenant's deletion lock, nor do the stats and the reaper's dry run;
a release leaves pending and settled rows as they are, and marking a delivery failed
bumps its generation, so its live holder's lease is lost."""

from __future__ import annotations

import time

from tests.support import factories
from tests.support.locks import QUICK, expire_all, key_of, statuses
from tests.support.second_session import other
from workflow_delivery import services
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import LeaseLost, Outcome


def test_operator_release_does_not_queue_behind_a_tenant_lock(lock_timeout):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(step.community.id)])
        started = time.monotonic()
        assert services.release_deliveries(step.community.id, [lease.delivery_id]) == []
        assert services.fail_deliveries(step.community.id, [lease.delivery_id]) == []
        assert time.monotonic() - started < QUICK
        executor.rollback()
    assert statuses([lease.delivery_id]) == ["claimed"]
    assert services.release_deliveries(step.community.id, [lease.delivery_id]) == [
        lease.delivery_id
    ]


def test_delivery_stats_and_the_dry_run_do_not_queue_behind_a_tenant_lock(lock_timeout):
    from io import StringIO

    from django.core.management import call_command

    step = factories.Step(targets=1)
    factories.committed(step)
    expire_all(step)
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(step.community.id)])
        started = time.monotonic()
        call_command("delivery_stats", "--json", stdout=StringIO())
        call_command("reap_deliveries", "--dry-run", stdout=StringIO())
        assert time.monotonic() - started < QUICK
        executor.rollback()


def test_operator_mark_failed_leaves_the_live_holder_lease_lost(db):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    assert services.fail_deliveries(step.community.id, [lease.delivery_id]) == [lease.delivery_id]
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    assert services.renew_delivery(lease) == LeaseLost()
    row = WorkflowAgentDelivery.objects.get(pk=lease.delivery_id)
    assert (row.status, row.lease_generation) == ("failed", lease.generation + 1)


def test_release_leaves_pending_and_settled_rows_as_they_are(db):
    step = factories.Step(targets=3)
    ids = [d.id for d in factories.committed(step)]
    held, _ = services.claim_delivery(step.community.id, step.targets[0])
    settled, _ = services.claim_delivery(step.community.id, step.targets[1])
    services.finish_delivery(settled, Outcome.FINISHED)
    before = {
        row["id"]: row
        for row in WorkflowAgentDelivery.objects.filter(id__in=ids).values(
            "id", "status", "lease_generation", "finished_at"
        )
    }
    assert services.release_deliveries(step.community.id, ids) == [held.delivery_id]
    after = {
        row["id"]: row
        for row in WorkflowAgentDelivery.objects.filter(id__in=ids).values(
            "id", "status", "lease_generation", "finished_at"
        )
    }
    pending_id = next(i for i in ids if i not in (held.delivery_id, settled.delivery_id))
    assert after[pending_id] == before[pending_id]
    assert after[settled.delivery_id] == before[settled.delivery_id]
    assert after[held.delivery_id]["status"] == "pending"
