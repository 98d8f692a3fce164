"""``manage.py retry_deliveries``: failed deliveries named by id or selected by community
(id or host), target, error and time of failure go back to pending, with the operator and
the reason on their timeline; a dry run counts them; bad selections are clear errors
that change nothing; a finished delivery is never reopened."""

from __future__ import annotations

import os
import signal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery

pytestmark = pytest.mark.django_db


def failed(step: factories.Step, target: bytes, error: str = "boom") -> object:
    lease, _ = services.claim_delivery(step.community.id, target)
    services.finish_delivery(lease, "failed", error=RuntimeError(error))
    return lease.delivery_id


def now() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0].isoformat()


def statuses(*ids) -> list[str]:
    found = dict(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("id", "status"))
    return [found[i] for i in ids]


def retry(*args: str, **options) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    options.setdefault("reason", "the upstream is back")
    call_command("retry_deliveries", *args, stdout=out, stderr=err, verbosity=0, **options)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def two_communities():
    first = factories.Step(owner=factories.community("First.Example"), targets=2)
    second = factories.Step(owner=factories.community("second.example"), targets=1)
    for step in (first, second):
        factories.committed(step)
    return first, second


def test_named_deliveries_are_retried_and_the_others_are_said_why_not(two_communities):
    first, _ = two_communities
    a = failed(first, first.targets[0])
    lease = claim_target(first, first.targets[1])
    services.finish_delivery(lease, "finished")
    b = lease.delivery_id
    out, err = retry(str(a), str(b), "0f0e6d8a-3c2b-4d8e-9a41-2b7d0c9e5f13", operator="alice")
    assert statuses(a, b) == ["pending", "finished"]
    assert "1 retried" in out
    assert f"{b}: not retried (it is finished, not failed)" in err
    assert "0f0e6d8a-3c2b-4d8e-9a41-2b7d0c9e5f13: not retried (no such delivery)" in err
    entry = DeliveryTransition.objects.filter(delivery_id=a).latest("id")
    assert (entry.kind, entry.actor, entry.reason) == (
        "operator_retried",
        "operator:alice",
        "the upstream is back",
    )


def claim_target(step: factories.Step, target: bytes):
    lease, _ = services.claim_delivery(step.community.id, target)
    return lease


@pytest.mark.parametrize("name", ["first.example", "FIRST.EXAMPLE", "id"])
def test_community_by_host_or_id_selects_only_its_failed_deliveries(two_communities, name):
    first, second = two_communities
    ours = [failed(first, target) for target in first.targets]
    theirs = failed(second, second.targets[0])
    community = str(first.community.id) if name == "id" else name
    out, _ = retry(community=community)
    assert statuses(*ours, theirs) == ["pending", "pending", "failed"]
    assert "2 retried" in out


def test_target_and_error_narrow_the_selection(two_communities):
    first, _ = two_communities
    a = failed(first, first.targets[0], error="SMTP refused")
    b = failed(first, first.targets[1], error="disk full")
    retry(community="first.example", error="smtp")
    assert statuses(a, b) == ["pending", "failed"]
    retry(target=first.targets[1].hex(), error="RuntimeError")
    assert statuses(a, b) == ["pending", "pending"]


def test_the_time_of_failure_narrows_the_selection(two_communities):
    first, _ = two_communities
    early = failed(first, first.targets[0])
    between = now()
    late = failed(first, first.targets[1])
    retry(community="first.example", failed_before=between)
    assert statuses(early, late) == ["pending", "failed"]
    retry(community="first.example", failed_since=between)
    assert statuses(early, late) == ["pending", "pending"]


def test_a_duration_means_that_long_ago(two_communities):
    first, _ = two_communities
    a = failed(first, first.targets[0])
    retry(community="first.example", failed_before="1h")
    assert statuses(a) == ["failed"]
    retry(community="first.example", failed_since="1h")
    assert statuses(a) == ["pending"]


def test_a_dry_run_counts_per_community_and_changes_nothing(two_communities):
    first, second = two_communities
    ids = [failed(first, first.targets[0]), failed(second, second.targets[0])]
    out, _ = retry(error="boom", dry_run=True, reason=None)
    assert "First.Example: would retry 1" in out and "second.example: would retry 1" in out
    assert "would retry 2 failed deliveries" in out
    assert statuses(*ids) == ["failed", "failed"]


def test_a_community_not_active_is_skipped_and_said(two_communities):
    first, second = two_communities
    ours, theirs = failed(first, first.targets[0]), failed(second, second.targets[0])
    factories.move_to(second.community.id, "quiescing")
    _, err = retry(error="boom")
    assert statuses(ours, theirs) == ["pending", "failed"]
    assert "second.example: 1 failed deliveries skipped (community not active)" in err


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((), {}, "select the deliveries to retry"),
        (("not-a-uuid",), {}, "delivery id: 'not-a-uuid' is not a UUID"),
        ((), {"community": "nowhere.example"}, "--community: no community has the id or host"),
        ((), {"target": "abc"}, "--target: 'abc' is not 32 bytes"),
        ((), {"error": "  "}, "--error: give a part"),
        ((), {"failed_since": "yesterday"}, "--failed-since: 'yesterday' is neither"),
        ((), {"failed_before": "2026-01-01T00:00:00"}, "--failed-before: .* is neither"),
        ((), {"error": "boom", "reason": "  "}, "--reason is required"),
        ((), {"error": "boom", "reason": None}, "--reason is required"),
        ((), {"error": "boom", "batch_size": 0}, "--batch-size must be a positive"),
        ((), {"error": "boom", "reason": "r" * 501}, "reason: must be at most 500"),
    ],
)
def test_a_bad_selection_is_a_clear_error_that_changes_nothing(
    two_communities, args, options, message
):
    first, _ = two_communities
    a = failed(first, first.targets[0])
    with pytest.raises(CommandError, match=message):
        retry(*args, **options)
    assert statuses(a) == ["failed"]
    assert not DeliveryTransition.objects.filter(kind="operator_retried").exists()


def test_sigterm_stops_after_the_current_batch(two_communities, monkeypatch):
    first, _ = two_communities
    ids = [failed(first, target) for target in first.targets]
    service = services.retry_failed_deliveries

    def retry_then_signal(*args, **kwargs):
        done = service(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return done

    monkeypatch.setattr(services, "retry_failed_deliveries", retry_then_signal)
    out, _ = retry(community="first.example", batch_size=1)
    assert out.strip() == "stopped by SIGTERM: 1 retried, 0 skipped"
    assert sorted(statuses(*ids)) == ["failed", "pending"]
