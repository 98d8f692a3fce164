"""Hostile callers: probing another tenant, malformed and oversized text, a dying connection.

Each probe either misses (None, LeaseLost, nothing released) or raises a clear error (a
ValueError subclass of the app's base error), never a database error, and the stored rows
are exactly what they were before.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import DatabaseError, InterfaceError, OperationalError, connection

from tests.support import factories
from tests.support.sessions import backend_pid, terminate
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, WorkflowDeliveryError
from workflow_delivery.models import Community, Event, WorkflowAgentDelivery, WorkflowRun
from workflow_delivery.protocol import (
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    ProtocolError,
)

HOSTILE = [
    "",
    " ",
    "'",
    '"',
    "\\",
    "%s",
    "%(id)s",
    "{0}",
    "\x00",
    "step\x00; DROP TABLE workflow_agent_deliveries; --",
    "' OR '1'='1",
    "'); DELETE FROM communities; --",
    "$$; SELECT pg_sleep(10); $$",
    "\ud800",
    "x" * 10_000,
    "é" * 10_000,
    "'" * 10_000,
    "00000000-0000-0000-0000-000000000000",
    "6F9619FF-8B86-D011-B42D-00C04FC964FF",
    "6f9619ff8b86d011b42d00c04fc964ff",
]
# Valid step ids (1-64 characters, not blank, no NUL) that look like an attack: they
# must be stored exactly as given, never interpreted.
NASTY_BUT_VALID_STEP_IDS = [
    "'",
    "%s",
    "' OR '1'='1",
    "'); DELETE FROM communities; --",
    "$$; SELECT pg_sleep(10); $$",
    "x" * 64,
]
INVALID_STEP_IDS = [
    "",
    " ",
    "\t\n",
    "\x00",
    "step\x00; DROP TABLE workflow_agent_deliveries; --",
    "\ud800",
    "x" * 65,
    "x" * 10_000,
    "é" * 10_000,
    "'" * 10_000,
]


def snapshot() -> tuple[list[tuple], list[tuple]]:
    deliveries = list(
        WorkflowAgentDelivery.objects.order_by("id").values_list(
            "id", "community_id", "status", "lease_generation", "lease_until", "finished_at"
        )
    )
    communities = list(
        Community.objects.order_by("id").values_list(
            "id", "host", "deletion_state", "deletion_fence_generation"
        )
    )
    return deliveries, communities


def refused_or_missed(name: str, call: Callable[[], Any]) -> None:
    """A hostile call must miss (None, nothing, False, LeaseLost) or raise the app's own
    clear error: bad input (a ValueError) or an unknown community (a LookupError)."""
    try:
        result = call()
    except DatabaseError as exc:
        pytest.fail(f"{name}: a database error escaped: {type(exc).__name__}: {exc}")
    except (ValueError, LookupError) as exc:
        assert isinstance(exc, WorkflowDeliveryError), f"{name}: not the app's error: {exc!r}"
        assert str(exc), f"{name}: an error without a message"
    else:
        assert result in (None, [], False) or result == LeaseLost(), f"{name} -> {result!r}"


@pytest.fixture
def tenants(db) -> tuple[factories.Step, factories.Step, Lease, Lease]:
    """Two communities, each with a claimed delivery and a pending one for the same agents."""
    mine = factories.Step(targets=2)
    theirs = factories.Step(targets=2)
    theirs.targets = mine.targets
    factories.enroll(theirs.community, mine.targets)
    leases = []
    for step in (mine, theirs):
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
        lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
        leases.append(lease)
    return mine, theirs, leases[0], leases[1]


def their_rows(theirs: factories.Step) -> list[WorkflowAgentDelivery]:
    return list(WorkflowAgentDelivery.objects.filter(community=theirs.community).order_by("id"))


class TestCrossTenantProbing:
    def test_claiming_another_communitys_delivery_id_misses(self, tenants):
        mine, theirs, _, _ = tenants
        before = snapshot()
        for row in their_rows(theirs):
            for target in mine.targets:
                claimed = services.claim_delivery(
                    mine.community.id, target, delivery_id=row.id, lease_seconds=60
                )
                assert claimed is None
        assert snapshot() == before

    def test_claiming_with_another_communitys_binding_misses(self, tenants):
        mine, theirs, _, _ = tenants
        before = snapshot()
        for target in mine.targets:
            binding = theirs.binding(target)
            for community in (mine.community.id, theirs.community.id):
                # In my community their binding's community is not mine; in theirs I
                # name a community I am not claiming in. Both are out of scope.
                scoped = dataclasses.replace(binding, community_id=community)
                assert (
                    services.claim_delivery(
                        mine.community.id, target, expected=binding, lease_seconds=60
                    )
                    is None
                )
                if community == mine.community.id:
                    assert (
                        services.claim_delivery(
                            mine.community.id, target, expected=scoped, lease_seconds=60
                        )
                        is None
                    )
        assert snapshot() == before

    def test_their_lease_presented_in_my_community_is_lost(self, tenants):
        mine, _, _, their_lease = tenants
        before = snapshot()
        forged = dataclasses.replace(their_lease, community_id=mine.community.id)
        assert services.renew_delivery(forged, lease_seconds=60) == LeaseLost()
        for outcome in Outcome:
            assert services.finish_delivery(forged, outcome) == LeaseLost()
        assert snapshot() == before

    def test_my_lease_pointed_at_their_delivery_is_lost(self, tenants):
        _, _, my_lease, their_lease = tenants
        before = snapshot()
        forged = dataclasses.replace(
            my_lease, delivery_id=their_lease.delivery_id, generation=their_lease.generation
        )
        assert services.renew_delivery(forged, lease_seconds=60) == LeaseLost()
        assert services.finish_delivery(forged, Outcome.FINISHED) == LeaseLost()
        assert snapshot() == before

    def test_operator_actions_scoped_to_my_community_leave_theirs_alone(self, tenants):
        mine, theirs, _, _ = tenants
        before = snapshot()
        ids = [row.id for row in their_rows(theirs)]
        assert services.release_deliveries(mine.community.id, ids) == []
        assert services.fail_deliveries(mine.community.id, ids) == []
        assert all(services.get_delivery(mine.community.id, i) is None for i in ids)
        assert snapshot() == before

    def test_committing_their_binding_in_my_step_writes_nothing(self, tenants):
        mine, theirs, _, _ = tenants
        before = snapshot()
        stray = NewDelivery(uuid.uuid4(), theirs.binding(mine.targets[1], step_id="s2"))
        with pytest.raises(ProtocolError):
            services.commit_deliveries(mine.community.id, mine.created_at, [stray])
        assert snapshot() == before


def hostile_calls(step: factories.Step, lease: Lease, value: Any) -> dict[str, Callable]:
    community, run, target = step.community.id, step.run.id, step.targets[0]

    def identity(**overrides: Any) -> Callable[[], Any]:
        fields = {"community_id": community, "run_id": run, "step_id": step.step_id}
        fields.update(overrides)

        def call() -> Any:
            with services.delivery_identity(**fields) as held:
                return held.exists

        return call

    return {
        "identity community_id": identity(community_id=value),
        "identity run_id": identity(run_id=value),
        "claim community_id": lambda: services.claim_delivery(value, target),
        "claim target_pubkey": lambda: services.claim_delivery(community, value),
        "claim delivery_id": lambda: services.claim_delivery(community, target, delivery_id=value),
        "claim lease_seconds": lambda: services.claim_delivery(
            community, target, lease_seconds=value
        ),
        "renew lease_seconds": lambda: services.renew_delivery(lease, lease_seconds=value),
        "renew lease": lambda: services.renew_delivery(value),
        "finish outcome": lambda: services.finish_delivery(lease, value),
        "finish lease": lambda: services.finish_delivery(value, Outcome.FINISHED),
        "get community_id": lambda: services.get_delivery(value, lease.delivery_id),
        "get delivery_id": lambda: services.get_delivery(community, value),
        "release community_id": lambda: services.release_deliveries(value, [lease.delivery_id]),
        "release delivery_id": lambda: services.release_deliveries(community, [value]),
        "fail delivery_id": lambda: services.fail_deliveries(community, [value]),
        "commit message_event_created_at": lambda: services.commit_deliveries(
            community, value, step.new_deliveries()
        ),
        "commit deliveries": lambda: services.commit_deliveries(community, step.created_at, value),
        "transition community_id": lambda: services.transition_community(value, "fenced"),
        "transition state": lambda: services.transition_community(community, value),
        "write allowed community_id": lambda: services.community_write_allowed(value),
        "purge community_id": lambda: services.purge_community(value, 0),
        "binding target_pubkey": lambda: step.binding(target_pubkey=value),
    }


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:24])
def test_hostile_text_in_every_input_is_refused_or_misses_and_changes_nothing(value, db):
    step = factories.Step(targets=2)
    services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
    before = snapshot()
    for name, call in hostile_calls(step, lease, value).items():
        refused_or_missed(name, call)
        assert snapshot() == before, f"{name} changed stored rows"


@pytest.mark.parametrize("value", INVALID_STEP_IDS, ids=lambda v: repr(v)[:24])
def test_an_invalid_step_id_is_refused_before_anything_is_written(value, db):
    step = factories.Step(targets=2)
    before = snapshot()
    with (
        pytest.raises(ProtocolError) as caught,
        services.delivery_identity(step.community.id, step.run.id, value),
    ):
        pass
    assert caught.value.field == "step_id"
    assert snapshot() == before


@pytest.mark.parametrize("value", NASTY_BUT_VALID_STEP_IDS, ids=lambda v: repr(v)[:24])
def test_a_step_id_that_looks_like_sql_is_stored_exactly_as_given(value, db):
    step = factories.Step(targets=2, step_id=value)
    created = services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    stored = WorkflowAgentDelivery.objects.filter(id__in=created).values_list("step_id", flat=True)
    assert list(stored) == [value, value]
    assert Community.objects.filter(id=step.community.id).exists()
    claimed = services.claim_delivery(
        step.community.id, step.targets[0], expected=step.binding(), lease_seconds=60
    )
    assert claimed is not None and claimed[1].binding.step_id == value


def test_a_fenced_community_with_a_hostile_host_refuses_with_a_clear_error(db):
    host = "'); DROP TABLE communities; -- %s {0} " + "é" * 10_000
    step = factories.Step(owner=factories.community(host=host), targets=2)
    factories.move_to(step.community.id, "fenced")
    before = snapshot()
    with pytest.raises(CommunityWriteFenced) as caught:
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    assert str(step.community.id) in str(caught.value)
    assert snapshot() == before
    assert Community.objects.get(id=step.community.id).host == host


def test_random_bytes_as_keys_and_ids_miss(db):
    step = factories.Step(targets=1)
    services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    before = snapshot()
    for _ in range(20):
        assert services.claim_delivery(step.community.id, os.urandom(32)) is None
        assert services.claim_delivery(uuid.uuid4(), step.targets[0]) is None
        assert services.get_delivery(step.community.id, uuid.uuid4()) is None
    assert snapshot() == before


def step_rows(step: factories.Step) -> tuple[int, int, int]:
    return (
        WorkflowAgentDelivery.objects.filter(run_id=step.run.id, step_id=step.step_id).count(),
        Event.objects.filter(community=step.community).count(),
        WorkflowRun.objects.filter(community=step.community).count(),
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("when", ["before the insert", "after the insert"])
def test_a_connection_dying_mid_commit_raises_and_leaves_no_partial_step(when):
    step = factories.Step(targets=3)
    before = step_rows(step)
    batch = step.new_deliveries()
    try:
        with (
            pytest.raises((OperationalError, InterfaceError)) as caught,
            services.delivery_identity(step.community.id, step.run.id, step.step_id) as held,
        ):
            # The producer's own write in the same transaction must vanish too.
            factories.message(step.community, step.targets)
            if when == "after the insert":
                assert len(held.commit(step.created_at, batch)) == 3
            terminate(backend_pid())
            if when == "before the insert":
                held.commit(step.created_at, batch)
        assert "terminat" in str(caught.value) or "closed" in str(caught.value)
    finally:
        connection.close()
    assert step_rows(step) == before
    # The step is whole once committed again on a fresh connection.
    created = services.commit_deliveries(step.community.id, step.created_at, batch)
    assert sorted(created) == sorted(item.id for item in batch)
