"""Builders of valid tenant rows and bindings for the tests (all through the ORM)."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime

from workflow_delivery import services
from workflow_delivery.models import Community, DeletionState, Event, Workflow, WorkflowRun
from workflow_delivery.protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    DeliveryBinding,
    EventCause,
    NewDelivery,
)
from workflow_delivery.services import commit_deliveries

LIFECYCLE = [DeletionState.ACTIVE, DeletionState.QUIESCING, DeletionState.FENCED]
LIFECYCLE.append(DeletionState.TOMBSTONE)


def key32() -> bytes:
    return os.urandom(32)


def whole_second_now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def move_to(community_id, state: str, **kwargs) -> int:
    """Walk a community forward one lifecycle step at a time to ``state`` (the only
    way the lifecycle moves); returns the last fence generation."""
    current = Community.objects.get(pk=community_id).deletion_state
    generation = Community.objects.get(pk=community_id).deletion_fence_generation
    for step in LIFECYCLE[LIFECYCLE.index(current) + 1 : LIFECYCLE.index(state) + 1]:
        generation = services.transition_community(community_id, step, **kwargs)
    return generation


def community(host: str | None = None) -> Community:
    return Community.objects.create(host=host or f"c-{uuid.uuid4().hex[:12]}.example")


def workflow(owner: Community) -> Workflow:
    return Workflow.objects.create(
        community=owner, name="triage", owner_pubkey=key32(), definition={"steps": []}
    )


def run(flow: Workflow) -> WorkflowRun:
    return WorkflowRun.objects.create(community_id=flow.community_id, workflow=flow)


def enroll(owner: Community, targets: list[bytes]) -> None:
    """Make ``targets`` enabled agents of ``owner`` (deliveries may be committed to them)."""
    services.enroll_agents(owner.id, targets)


def message(owner: Community, targets: list[bytes], created_at: datetime | None = None) -> Event:
    tags = [["p", target.hex(), "", MESSAGE_V1_MARKER] for target in targets]
    return Event.objects.create(
        id=key32(),
        community=owner,
        created_at=created_at or whole_second_now(),
        kind=MESSAGE_KIND,
        pubkey=key32(),
        content="please review",
        tags=tags,
    )


class Step:
    """One workflow step of one run with its message, ready to bind deliveries to."""

    def __init__(
        self,
        owner: Community | None = None,
        targets: int | list[bytes] = 1,
        step_id: str = "step-1",
    ):
        self.community = owner or community()
        self.workflow = workflow(self.community)
        self.run = run(self.workflow)
        self.targets = (
            list(targets) if isinstance(targets, list) else [key32() for _ in range(targets)]
        )
        enroll(self.community, self.targets)
        self.message = message(self.community, self.targets)
        self.step_id = step_id
        self.definition_event_id = key32()
        self.cause = EventCause(key32())

    def binding(self, target: bytes | None = None, **overrides) -> DeliveryBinding:
        fields = dict(
            community_id=self.community.id,
            workflow_id=self.workflow.id,
            run_id=self.run.id,
            step_id=self.step_id,
            target_pubkey=target if target is not None else self.targets[0],
            definition_event_id=self.definition_event_id,
            message_event_id=bytes(self.message.id),
            cause=self.cause,
        )
        fields.update(overrides)
        return DeliveryBinding(**fields)

    def new_deliveries(self) -> list[NewDelivery]:
        return [NewDelivery(uuid.uuid4(), self.binding(target)) for target in self.targets]

    @property
    def created_at(self) -> datetime:
        return self.message.created_at


def committed(step: Step) -> list[NewDelivery]:
    """Commit one delivery per target of ``step`` through the service; return them."""
    deliveries = step.new_deliveries()
    commit_deliveries(step.community.id, step.created_at, deliveries)
    return deliveries
