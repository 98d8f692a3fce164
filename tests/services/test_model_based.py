"""Random sequences of operations against the database, checked step by step against a
pure-Python model of SPEC §5.

Everything runs inside the test's transaction, where ``now()`` stands still: a lease expires
only when a rule moves its ``lease_until`` into the past, so the model never guesses at clocks.
Each example works in a savepoint that is rolled back afterwards, so every example starts from
an empty table (the reaper sweeps every community, so leftovers would change its answers).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, InvalidLifecycleTransition
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryBinding,
    EventCause,
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    Renewed,
    ScheduleCause,
    Settled,
    WebhookCause,
)

STEPS = ["ask", "remind", "close"]
STATES = ["active", "quiescing", "fenced", "tombstone"]
LEASE_SECONDS = 60
# The one field of a binding an expected binding gets wrong (or none).
PERTURBATIONS = [
    None,
    "step_id",
    "workflow_id",
    "run_id",
    "definition_event_id",
    "message_event_id",
    "cause_kind",
    "cause_identity",
    "community_id",
    "target_pubkey",
]

# Rows of the machine's communities that break a SPEC §3 rule (the CHECKs make it 0).
BROKEN_ROWS = """
SELECT count(*) FROM workflow_agent_deliveries
 WHERE community_id = ANY(%s)
   AND (status NOT IN ('pending', 'claimed', 'finished', 'failed')
        OR lease_generation < 0
        OR (status = 'claimed') <> (lease_until IS NOT NULL)
        OR (status = 'claimed') <> (claimed_at IS NOT NULL)
        OR (status IN ('finished', 'failed')) <> (finished_at IS NOT NULL))
"""


@dataclass
class Row:
    """The model of one delivery."""

    id: uuid.UUID
    binding: DeliveryBinding
    status: str = "pending"
    generation: int = 0
    expired: bool = False


@dataclass
class Tenant:
    step: factories.Step
    state: str = "active"
    fence_generation: int = 0

    @property
    def id(self) -> uuid.UUID:
        return self.step.community.id

    @property
    def active(self) -> bool:
        return self.state == "active"


def other_cause(cause: object) -> object:
    if isinstance(cause, EventCause):
        return WebhookCause(uuid.uuid4())
    return EventCause(os.urandom(32))


def perturb(binding: DeliveryBinding, field: str | None, tenants: list[Tenant]) -> DeliveryBinding:
    if field is None:
        return binding
    if field == "step_id":
        return dataclasses.replace(binding, step_id=binding.step_id + "-x")
    if field in ("workflow_id", "run_id"):
        return dataclasses.replace(binding, **{field: uuid.uuid4()})
    if field in ("definition_event_id", "message_event_id"):
        return dataclasses.replace(binding, **{field: os.urandom(32)})
    if field == "cause_kind":
        return dataclasses.replace(binding, cause=other_cause(binding.cause))
    if field == "cause_identity":
        cause = binding.cause
        if isinstance(cause, EventCause):
            return dataclasses.replace(binding, cause=EventCause(os.urandom(32)))
        if isinstance(cause, WebhookCause):
            return dataclasses.replace(binding, cause=WebhookCause(uuid.uuid4()))
        return dataclasses.replace(
            binding, cause=ScheduleCause(cause.scheduled_for.replace(year=2001))
        )
    if field == "community_id":
        other = next(t.id for t in tenants if t.id != binding.community_id)
        return dataclasses.replace(binding, community_id=other)
    return dataclasses.replace(binding, target_pubkey=os.urandom(32))


class DeliveryMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        # An atomic block (a savepoint inside the test's transaction) that teardown
        # rolls back; transaction.savepoint() itself is deprecated from Django 6.1.
        self.example = transaction.atomic()
        self.example.__enter__()
        self.tenants = [Tenant(factories.Step(targets=2)) for _ in range(2)]
        # Both tenants address the same two agents, so cross-tenant probes name real targets.
        for tenant in self.tenants[1:]:
            tenant.step.targets = self.tenants[0].step.targets
            factories.enroll(tenant.step.community, tenant.step.targets)
        self.rows: dict[uuid.UUID, Row] = {}
        self.issued = 0

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self.example.__exit__(None, None, None)

    @property
    def targets(self) -> list[bytes]:
        return self.tenants[0].step.targets

    def tenant_of(self, community_id: uuid.UUID) -> Tenant:
        return next(t for t in self.tenants if t.id == community_id)

    @initialize()
    def start_empty(self) -> None:
        assert WorkflowAgentDelivery.objects.count() == 0

    # -- producer ------------------------------------------------------------------------

    @rule(
        tenant=st.integers(0, 1),
        step_id=st.sampled_from(STEPS),
        chosen=st.sets(st.integers(0, 1), min_size=1),
        cause=st.sampled_from(["event", "schedule", "webhook"]),
    )
    def commit(self, tenant: int, step_id: str, chosen: set[int], cause: str) -> None:
        owner = self.tenants[tenant]
        made = {
            "event": lambda: EventCause(os.urandom(32)),
            "schedule": lambda: ScheduleCause(factories.whole_second_now()),
            "webhook": lambda: WebhookCause(uuid.uuid4()),
        }[cause]()
        batch = []
        for i in sorted(chosen):
            # Ids decide the claim order among rows created in one transaction, so they
            # must repeat when hypothesis replays an example.
            self.issued += 1
            batch.append(
                NewDelivery(
                    uuid.UUID(int=self.issued),
                    owner.step.binding(self.targets[i], step_id=step_id, cause=made),
                )
            )
        existing = {
            (r.binding.community_id, r.binding.step_id, r.binding.target_pubkey)
            for r in self.rows.values()
        }
        fresh = [
            item
            for item in batch
            if (owner.id, step_id, item.binding.target_pubkey) not in existing
        ]
        # The fence trigger fires before ON CONFLICT looks for a duplicate, so even a
        # retry that would create nothing is refused in a community that is not active.
        if not owner.active:
            with pytest.raises(CommunityWriteFenced):
                services.commit_deliveries(owner.id, owner.step.created_at, batch)
            return
        created = services.commit_deliveries(owner.id, owner.step.created_at, batch)
        assert sorted(created) == sorted(item.id for item in fresh)
        for item in fresh:
            self.rows[item.id] = Row(item.id, item.binding)

    # -- agent ---------------------------------------------------------------------------

    def _expected_claim(
        self, tenant: Tenant, target: bytes, delivery_id: uuid.UUID | None, expected
    ) -> Row | None:
        if expected is not None and (
            expected.community_id != tenant.id or expected.target_pubkey != target
        ):
            return None
        candidates = [
            row
            for row in self.rows.values()
            if row.binding.community_id == tenant.id
            and row.binding.target_pubkey == target
            and row.status == "pending"
            and (delivery_id is None or row.id == delivery_id)
            and (expected is None or row.binding == expected)
        ]
        # Every row was created in this transaction, so created_at ties and id decides.
        return min(candidates, key=lambda row: row.id, default=None)

    def _attempt(self, writes_to: Row | None, call: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``call`` in a savepoint. When the model says it writes to a row of a
        community that is not active, the fence must refuse it: returns (True, None)."""
        if writes_to is not None and not self.tenant_of(writes_to.binding.community_id).active:
            with pytest.raises(CommunityWriteFenced), transaction.atomic():
                call()
            return True, None
        with transaction.atomic():
            return False, call()

    def _claim(self, tenant: Tenant, target: bytes, delivery_id=None, expected=None):
        winner = self._expected_claim(tenant, target, delivery_id, expected)
        fenced, claimed = self._attempt(
            winner,
            lambda: services.claim_delivery(
                tenant.id,
                target,
                delivery_id=delivery_id,
                expected=expected,
                lease_seconds=LEASE_SECONDS,
            ),
        )
        if fenced:
            return multiple()
        if winner is None:
            assert claimed is None
            return multiple()
        assert claimed is not None
        lease, record = claimed
        winner.status, winner.generation, winner.expired = "claimed", winner.generation + 1, False
        assert record.id == winner.id == lease.delivery_id
        assert record.binding == winner.binding
        assert record.status == "claimed"
        assert record.lease_generation == lease.generation == winner.generation
        assert lease.target_pubkey == target and lease.community_id == tenant.id
        return lease

    @rule(target=leases, tenant=st.integers(0, 1), agent=st.integers(0, 1))
    def claim_oldest(self, tenant: int, agent: int):
        return self._claim(self.tenants[tenant], self.targets[agent])

    @precondition(lambda self: self.rows)
    @rule(target=leases, tenant=st.integers(0, 1), agent=st.integers(0, 1), data=st.data())
    def claim_by_id(self, tenant: int, agent: int, data: st.DataObject):
        delivery_id = data.draw(st.sampled_from(sorted(self.rows)))
        return self._claim(self.tenants[tenant], self.targets[agent], delivery_id=delivery_id)

    @precondition(lambda self: self.rows)
    @rule(target=leases, field=st.sampled_from(PERTURBATIONS), data=st.data())
    def claim_expecting(self, field: str | None, data: st.DataObject):
        row = self.rows[data.draw(st.sampled_from(sorted(self.rows)))]
        expected = perturb(row.binding, field, self.tenants)
        tenant = self.tenant_of(row.binding.community_id)
        return self._claim(tenant, row.binding.target_pubkey, expected=expected)

    @rule(target=leases, lease=leases, how=st.sampled_from(["target", "generation", "tenant"]))
    def forge(self, lease: Lease, how: str):
        """A capability that was never issued: another agent's, a future one, another tenant's."""
        if how == "target":
            other = next(t for t in self.targets if t != lease.target_pubkey)
            return dataclasses.replace(lease, target_pubkey=other)
        if how == "generation":
            return dataclasses.replace(lease, generation=lease.generation + 1)
        other = next(t.id for t in self.tenants if t.id != lease.community_id)
        return dataclasses.replace(lease, community_id=other)

    def _live(self, lease: Lease) -> Row | None:
        row = self.rows.get(lease.delivery_id)
        if (
            row is None
            or row.binding.community_id != lease.community_id
            or row.binding.target_pubkey != lease.target_pubkey
            or row.generation != lease.generation
            or row.status != "claimed"
            or row.expired
        ):
            return None
        return row

    @rule(lease=leases)
    def renew(self, lease: Lease) -> None:
        row = self._live(lease)
        fenced, result = self._attempt(
            row, lambda: services.renew_delivery(lease, lease_seconds=LEASE_SECONDS)
        )
        if fenced:
            return
        if row is None:
            assert result == LeaseLost()
        else:
            assert isinstance(result, Renewed)

    @rule(lease=leases, outcome=st.sampled_from(list(Outcome)))
    def finish(self, lease: Lease, outcome: Outcome) -> None:
        row = self._live(lease)
        fenced, result = self._attempt(row, lambda: services.finish_delivery(lease, outcome))
        if fenced:
            return
        if row is not None:
            assert result == Settled(outcome)
            row.status = outcome.value
            return
        own = self.rows.get(lease.delivery_id)
        if (
            own is not None
            and own.binding.community_id == lease.community_id
            and own.binding.target_pubkey == lease.target_pubkey
            and own.generation == lease.generation
            and own.status in ("finished", "failed")
        ):
            assert result == AlreadyTerminal(own.status)
        else:
            assert result == LeaseLost()

    # -- time, reaper, lifecycle ---------------------------------------------------------

    @precondition(
        lambda self: any(
            r.status == "claimed" and self.tenant_of(r.binding.community_id).active
            for r in self.rows.values()
        )
    )
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        claimed = sorted(
            r.id
            for r in self.rows.values()
            if r.status == "claimed" and self.tenant_of(r.binding.community_id).active
        )
        row = self.rows[data.draw(st.sampled_from(claimed))]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "UPDATE workflow_agent_deliveries "
                "SET lease_until = now() - interval '1 second' WHERE id = %s",
                [row.id],
            )
        row.expired = True

    @rule(batch_size=st.integers(1, 3))
    def reap(self, batch_size: int) -> None:
        due = [
            r
            for r in self.rows.values()
            if r.status == "claimed" and r.expired and self.tenant_of(r.binding.community_id).active
        ]
        with transaction.atomic():
            reaped = services.reap_expired_deliveries(batch_size=batch_size)
        assert reaped == len(due)
        for row in due:
            row.status, row.generation, row.expired = "pending", row.generation + 1, False

    @rule(tenant=st.integers(0, 1), state=st.sampled_from(STATES))
    def transition(self, tenant: int, state: str) -> None:
        owner = self.tenants[tenant]
        current = STATES.index(owner.state)
        wanted = STATES.index(state)
        cancel = (owner.state, state) == ("quiescing", "active")
        if wanted not in (current, current + 1) and not cancel:
            with pytest.raises(InvalidLifecycleTransition), transaction.atomic():
                services.transition_community(owner.id, state)
            return
        with transaction.atomic():
            generation = services.transition_community(owner.id, state)
        if wanted != current:
            owner.state, owner.fence_generation = state, owner.fence_generation + 1
        assert generation == owner.fence_generation

    # -- after every step ----------------------------------------------------------------

    @invariant()
    def table_matches_the_model(self) -> None:
        stored = {
            row["id"]: row
            for row in WorkflowAgentDelivery.objects.filter(
                community_id__in=[t.id for t in self.tenants]
            ).values("id", "status", "lease_generation", "lease_until")
        }
        assert stored.keys() == self.rows.keys()
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            now = cursor.fetchone()[0]
        for delivery_id, row in self.rows.items():
            found = stored[delivery_id]
            assert (found["status"], found["lease_generation"]) == (row.status, row.generation)
            if row.status == "claimed":
                assert (found["lease_until"] < now) is row.expired

    @invariant()
    def no_rule_of_the_table_is_broken(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(BROKEN_ROWS, [[t.id for t in self.tenants]])
            assert cursor.fetchone()[0] == 0

    @invariant()
    def communities_match_the_model(self) -> None:
        stored = dict(
            Community.objects.filter(id__in=[t.id for t in self.tenants]).values_list(
                "id", "deletion_state"
            )
        )
        assert stored == {t.id: t.state for t in self.tenants}


def test_operations_agree_with_the_model_of_spec_section_5(db) -> None:
    run_state_machine_as_test(
        DeliveryMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            # Shrinking replays hundreds of examples against the database and would outlast
            # the suite's timeout; a failure prints its whole (at most 30-step) sequence.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
