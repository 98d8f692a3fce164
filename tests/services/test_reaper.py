"""The reaper's sweep while other sessions hold locks: it reclaims every expired lease
no one holds, skips (never waits on) a row someone locked or a tenant whose deletion lock
is taken, never reads the rows parked in a fenced community, and plans its batch once per
session; its loop refuses an endless interval."""

from __future__ import annotations

import math
import time
import uuid

import pytest
from django.db import connection

from tests.support import factories
from tests.support.locks import QUICK, expire_all, key_of, statuses, wait_until_blocked
from tests.support.second_session import other
from workflow_delivery import checks, services
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.reaper import Reaper


def status_set(ids) -> set[str]:
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
    assert status_set([held[5], *free]) == {"pending"}
    assert status_set(held[:5]) == {"claimed"}


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
    assert status_set(free) == {"pending"}


def test_reaper_skips_a_tenant_whose_deletion_lock_is_held_and_reclaims_the_rest(lock_timeout):
    healthy, frozen = factories.Step(targets=2), factories.Step(targets=2)
    factories.committed(healthy)
    factories.committed(frozen)
    healthy_ids, frozen_ids = expire_all(healthy), expire_all(frozen)
    skipped: list[uuid.UUID] = []
    with other() as executor:
        # A deletion executor mid-transition or mid-purge holds the exclusive lock.
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(frozen.community.id)])
        started = time.monotonic()
        reclaimed = services.reap_expired_deliveries(on_locked=skipped.extend)
        elapsed = time.monotonic() - started
        sweep = Reaper(batch_size=10).sweep()
        executor.rollback()
    assert reclaimed == 2
    assert elapsed < QUICK
    assert skipped == [frozen.community.id]
    assert sweep.skipped_locked == 1
    assert statuses(healthy_ids) == ["pending", "pending"]
    assert statuses(frozen_ids) == ["claimed", "claimed"]
    # Once the executor is gone the next sweep reclaims the tenant.
    assert services.reap_expired_deliveries() == 2


def test_reaper_skips_a_tenant_whose_transition_is_queued_behind_a_slow_producer(
    lock_timeout, worker
):
    healthy, frozen = factories.Step(targets=1), factories.Step(targets=1)
    factories.committed(healthy)
    factories.committed(frozen)
    healthy_ids, frozen_ids = expire_all(healthy), expire_all(frozen)
    later = factories.Step(owner=frozen.community, targets=1, step_id="slow")
    with other() as producer:
        # A producer past the fence (shared lock, uncommitted insert) ...
        producer.execute("SELECT pg_advisory_xact_lock_shared(%s)", [key_of(frozen.community.id)])
        # ... and a transition queued behind it for the exclusive lock.
        moving = worker.submit(services.transition_community, later.community.id, "quiescing")
        wait_until_blocked(worker.pid)
        started = time.monotonic()
        skipped: list[uuid.UUID] = []
        assert services.reap_expired_deliveries(on_locked=skipped.extend) == 1
        assert time.monotonic() - started < QUICK
        producer.commit()
    assert moving.result(timeout=30) == 1
    assert skipped == [frozen.community.id]
    assert statuses(healthy_ids) == ["pending"]
    assert statuses(frozen_ids) == ["claimed"]


def test_reap_command_reports_the_tenants_skipped_because_locked(lock_timeout):
    from django.core.management import call_command

    frozen = factories.Step(targets=1)
    factories.committed(frozen)
    expire_all(frozen)
    from io import StringIO

    out = StringIO()
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(frozen.community.id)])
        call_command("reap_deliveries", stdout=out)
        executor.rollback()
    assert "skipped 1 communities whose deletion lock was taken" in out.getvalue()


def rows_read(cursor) -> int:
    cursor.execute(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
        "FROM pg_stat_xact_user_tables WHERE relname = 'workflow_agent_deliveries'"
    )
    return cursor.fetchone()[0]


def park_expired_leases(count: int) -> factories.Step:
    """``count`` leases that expired an hour ago, in a community then fenced."""
    parked = factories.Step(targets=[factories.key32() for _ in range(count)])
    factories.committed(parked)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET status = 'claimed', lease_generation = 1, "
            "claimed_at = now() - interval '1 hour', lease_until = now() - interval '1 hour' "
            "WHERE community_id = %s",
            [parked.community.id],
        )
    factories.move_to(parked.community.id, "fenced")
    return parked


def test_reap_batch_does_not_read_the_rows_parked_in_a_fenced_community(db, raw):
    park_expired_leases(3000)
    healthy = factories.Step(targets=3)
    factories.committed(healthy)
    expire_all(healthy)
    # Statistics, as autovacuum keeps them on a live table: without any, a planner
    # (PostgreSQL 14's) may scan the whole table whatever the statement says.
    raw.execute("ANALYZE workflow_agent_deliveries")
    before = rows_read(raw)
    assert services.reap_expired_deliveries(batch_size=2, yield_ratio=0) == 3
    # Two batches of the 3 healthy rows (plus the probes of their community), never
    # the 3,000 parked ones.
    assert rows_read(raw) - before < 50


@pytest.mark.django_db(transaction=True)
@pytest.mark.psycopg3  # the statements a session prepared, through the app's lane
def test_a_sweep_past_parked_rows_plans_its_batch_once_per_session():
    # Parked expired leases make a parameterised batch dearer to plan generically than
    # afresh, so PostgreSQL would plan it again at every batch: the batch's size and
    # cap are written into its text (sql.reap_batch), one plan per session.
    park_expired_leases(3000)
    healthy = factories.Step(targets=4)
    factories.committed(healthy)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflow_agent_deliveries")
    for _ in range(4):
        expire_all(healthy)
        assert services.reap_expired_deliveries(batch_size=1, yield_ratio=0) == 4
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%candidates AS MATERIALIZED%%'"
        )
        plans = cursor.fetchall()
    # One statement, kept: 4 sweeps of 4 batches and the empty batch that ends each.
    assert plans == [(20, 0)]


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_an_endless_reap_interval_is_refused(settings, value):
    settings.WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS = value
    assert "workflow_delivery.E004" in [error.id for error in checks.check_settings()]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_reap_deliveries_refuses_an_endless_interval(db, value):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--interval must be a positive number"):
        call_command("reap_deliveries", "--loop", "--max-sweeps", "1", f"--interval={value}")
