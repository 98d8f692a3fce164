"""A consumer that serves a community's whole roster (``roster_interval``, the command's
``--all-enrolled``): an agent enrolled after it started is served, a revoked one is no
longer claimed for, its in-flight lease lost as a revocation releases it."""

from __future__ import annotations

import threading
import uuid

import pytest

from tests.support import factories
from tests.support.consumers import Recorder, Running, eventually, status
from workflow_delivery import services
from workflow_delivery.consumer import Consumer
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus, NewDelivery

pytestmark = pytest.mark.django_db(transaction=True)


def roster_consumer(owner, handler) -> Consumer:
    return Consumer(
        owner.id,
        [],
        handler,
        lease_seconds=2,
        grace_seconds=2,
        poll_interval=0.05,
        roster_interval=0.1,
        listen=False,
    )


def one_for(step: factories.Step, target: bytes) -> uuid.UUID:
    """A new delivery to ``target``, in a step of its own."""
    delivery = NewDelivery(uuid.uuid4(), step.binding(target, step_id=uuid.uuid4().hex[:12]))
    services.commit_deliveries(step.community.id, step.created_at, [delivery])
    return delivery.id


def test_an_agent_enrolled_after_the_start_is_served():
    step = factories.Step(targets=1)
    handler = Recorder()
    with Running(roster_consumer(step.community, handler)) as running:
        first = one_for(step, step.targets[0])
        assert eventually(lambda: status(first) == DeliveryStatus.FINISHED)
        late = factories.key32()
        factories.enroll(step.community, [late])
        assert eventually(lambda: late in running.consumer.targets)
        second = one_for(step, late)
        assert eventually(lambda: status(second) == DeliveryStatus.FINISHED)


def test_a_revoked_agent_is_no_longer_claimed_for():
    step = factories.Step(targets=2)
    revoked, kept = step.targets
    release = threading.Event()
    handler = Recorder(lambda record, lease, context: release.wait(10))
    with Running(roster_consumer(step.community, handler)) as running:
        held = one_for(step, revoked)
        assert handler.entered.wait(5)
        assert services.revoke_agent(step.community.id, revoked).released == (held,)
        assert eventually(lambda: revoked not in running.consumer.targets)
        release.set()  # the handler returns; its lease is lost, its row left pending
        after = one_for(step, kept)
        assert eventually(lambda: status(after) == DeliveryStatus.FINISHED)
        stats = running.consumer.stats
    row = WorkflowAgentDelivery.objects.get(pk=held)
    assert (row.status, row.attempts) == ("pending", 1)
    assert stats.claimed == 2


def test_a_bad_roster_interval_is_named():
    owner = factories.community()
    with pytest.raises(ProtocolError) as caught:
        Consumer(owner.id, [], Recorder(), roster_interval=0)
    assert caught.value.field == "roster_interval"
