"""Retention: only terminal rows settled before the cut-off go, with their timeline;
pending and claimed rows never; fenced tenants are untouched; batches are bounded; a
dry run writes nothing."""

from __future__ import annotations

import os
import signal
import threading
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery

pytestmark = pytest.mark.django_db


def settled_step(targets: int, age: str = "2 days", owner=None) -> factories.Step:
    """A step whose deliveries were all claimed and then settled ``age`` ago."""
    step = factories.Step(owner, targets=targets)
    factories.committed(step)
    for target in step.targets:
        assert services.claim_delivery(step.community.id, target)
    # A settle written as of ``age`` ago (a terminal row's finished_at never changes).
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET status = 'finished', "
            "finished_at = now() - %s::interval, lease_until = NULL, claimed_at = NULL "
            "WHERE community_id = %s",
            [age, step.community.id],
        )
    return step


def left(step: factories.Step) -> int:
    return WorkflowAgentDelivery.objects.filter(community=step.community).count()


def run(*args: str) -> str:
    out = StringIO()
    call_command("prune_deliveries", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_only_terminal_rows_older_than_the_cut_off_go_with_their_timeline():
    old = settled_step(3, "2 days")
    recent = settled_step(2, "1 hour")
    waiting = factories.Step(targets=2)
    factories.committed(waiting)
    held = factories.Step(targets=1)
    factories.committed(held)
    services.claim_delivery(held.community.id, held.targets[0])
    # Pending and claimed rows are never pruned, however old they are.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET created_at = created_at - interval '400 days' "
            "WHERE community_id = ANY(%s)",
            [[waiting.community.id, held.community.id]],
        )
    old_ids = list(
        WorkflowAgentDelivery.objects.filter(community=old.community).values_list("id", flat=True)
    )
    assert services.prune_deliveries(older_than="1d") == 3
    assert left(old) == 0
    assert not DeliveryTransition.objects.filter(delivery_id__in=old_ids).exists()
    assert (left(recent), left(waiting), left(held)) == (2, 2, 1)
    assert services.prune_deliveries(older_than="0s") == 2
    assert (left(recent), left(waiting), left(held)) == (0, 2, 1)


@pytest.mark.parametrize("state", ["quiescing", "fenced"])
def test_a_non_active_community_is_skipped_inside_the_statement(state):
    healthy = settled_step(2)
    frozen = settled_step(2)
    services.begin_deletion(frozen.community.id)
    if state == "fenced":
        services.transition_community(frozen.community.id, "fenced")
    assert services.prune_deliveries(older_than="1d") == 2
    assert (left(healthy), left(frozen)) == (0, 2)


@pytest.mark.django_db(transaction=True)
def test_a_community_whose_deletion_lock_is_taken_is_skipped_without_waiting():
    healthy = settled_step(2)
    locked = settled_step(2)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(
                "SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))",
                [locked.community.id],
            )
            # Would block forever on a waiting lock; a try skips the tenant.
            assert services.prune_deliveries(older_than="1d") == 2
            cursor.execute("ROLLBACK")
    finally:
        other.close()
    assert (left(healthy), left(locked)) == (0, 2)
    assert services.prune_deliveries(older_than="1d") == 2


def test_batches_are_bounded():
    settled_step(7)
    batches: list[int] = []
    pruned = services.prune_deliveries(
        older_than="1d", batch_size=3, yield_ratio=0, on_batch=lambda n, _: batches.append(n)
    )
    assert pruned == 7 and batches == [3, 3, 1]


def test_pruning_rests_by_its_own_setting_not_the_reapers(settings, monkeypatch):
    settled_step(5)
    settings.WORKFLOW_DELIVERY_REAP_YIELD_RATIO = 50.0
    settings.WORKFLOW_DELIVERY_PRUNE_YIELD_RATIO = 0.5
    timings: list[float] = []
    rests: list[float] = []
    monkeypatch.setattr(services.maintenance.time, "sleep", rests.append)
    pruned = services.prune_deliveries(
        older_than="1d", batch_size=2, on_batch=lambda _, seconds: timings.append(seconds)
    )
    assert pruned == 5
    assert rests == pytest.approx([0.5 * timings[0], 0.5 * timings[1]])


def test_dry_run_counts_per_community_and_writes_nothing():
    first = settled_step(2)
    second = settled_step(1)
    out = run("--older-than", "1d", "--dry-run")
    assert f"{first.community.host}: would prune 2" in out
    assert f"{second.community.host}: would prune 1" in out
    assert "would prune 3 terminal deliveries" in out
    assert (left(first), left(second)) == (2, 1)


def test_the_command_prunes_and_reports():
    step = settled_step(3)
    assert "pruned 3 terminal deliveries" in run("--older-than", "24h", "--batch-size", "2")
    assert left(step) == 0


@pytest.mark.parametrize("value", ["30", "1w", "-5d", "1.5h", "", "d"])
def test_a_bad_duration_is_a_clear_error(value):
    with pytest.raises(CommandError, match="--older-than"):
        run("--older-than", value)
    with pytest.raises(ProtocolError, match="duration"):
        services.prune_deliveries(older_than=value)


def test_a_bad_batch_size_is_a_clear_error():
    with pytest.raises(CommandError, match="--batch-size"):
        run("--older-than", "1d", "--batch-size", "0")


def test_the_default_retention_comes_from_the_setting(settings):
    step = settled_step(1, "2 hours")
    settings.WORKFLOW_DELIVERY_RETENTION = "3h"
    assert services.prune_deliveries() == 0
    settings.WORKFLOW_DELIVERY_RETENTION = "1h"
    assert services.prune_deliveries() == 1
    assert left(step) == 0


def test_sigterm_stops_after_the_current_batch(monkeypatch):
    settled_step(6)
    real = services.prune_deliveries

    def prune_then_signal(**kwargs):
        on_batch = kwargs["on_batch"]

        def first_batch_signals(count: int, seconds: float) -> None:
            on_batch(count, seconds)
            os.kill(os.getpid(), signal.SIGTERM)

        return real(**{**kwargs, "on_batch": first_batch_signals})

    monkeypatch.setattr(services, "prune_deliveries", prune_then_signal)
    assert threading.current_thread() is threading.main_thread()
    out = run("--older-than", "1d", "--batch-size", "2")
    assert "stopped by SIGTERM: pruned 2 terminal deliveries" in out
    assert WorkflowAgentDelivery.objects.count() == 4


@pytest.mark.django_db(transaction=True)
def test_the_reaper_loop_prunes_when_asked():
    step = settled_step(2)
    out = StringIO()
    call_command(
        "reap_deliveries",
        "--loop",
        "--max-sweeps",
        "1",
        "--prune",
        "--older-than",
        "1d",
        stdout=out,
    )
    assert "pruned 2 terminal deliveries" in out.getvalue()
    assert left(step) == 0
    kept = settled_step(1)
    call_command("reap_deliveries", "--loop", "--max-sweeps", "1", stdout=StringIO())
    assert left(kept) == 1


def test_older_than_needs_prune():
    with pytest.raises(CommandError, match="--prune"):
        call_command("reap_deliveries", "--older-than", "1d", stdout=StringIO())
