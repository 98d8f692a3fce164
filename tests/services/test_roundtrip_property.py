"""Property: any valid binding survives commit -> get unchanged, and claims by itself."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.models import Community, Event, Workflow, WorkflowRun
from workflow_delivery.protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    STEP_ID_MAX_LENGTH,
    DeliveryBinding,
    DeliveryStatus,
    EventCause,
    NewDelivery,
    ScheduleCause,
    WebhookCause,
)

bytes32 = st.binary(min_size=32, max_size=32)
offsets = st.integers(min_value=-14 * 60, max_value=14 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
instants = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=offsets
)
step_ids = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=STEP_ID_MAX_LENGTH,
).filter(lambda value: not value.isspace())
causes = st.one_of(
    bytes32.map(EventCause),
    instants.map(lambda instant: ScheduleCause(instant.replace(microsecond=0))),
    st.uuids().map(WebhookCause),
)
bindings = st.builds(
    DeliveryBinding,
    community_id=st.uuids().filter(lambda value: value.int != 0),
    workflow_id=st.uuids(),
    run_id=st.uuids(),
    step_id=step_ids,
    target_pubkey=bytes32,
    definition_event_id=bytes32,
    message_event_id=bytes32,
    cause=causes,
)


def store_the_rows_it_names(binding: DeliveryBinding, message_created_at: datetime) -> None:
    owner = Community.objects.create(id=binding.community_id, host=f"p-{uuid.uuid4().hex}.test")
    flow = Workflow.objects.create(
        id=binding.workflow_id, community=owner, name="prop", owner_pubkey=factories.key32()
    )
    WorkflowRun.objects.create(id=binding.run_id, community=owner, workflow=flow)
    factories.enroll(owner, [binding.target_pubkey])
    Event.objects.create(
        id=binding.message_event_id,
        community=owner,
        created_at=message_created_at,
        kind=MESSAGE_KIND,
        pubkey=factories.key32(),
        tags=[["p", binding.target_pubkey.hex(), "", MESSAGE_V1_MARKER]],
    )


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(binding=bindings, message_created_at=instants, delivery_id=st.uuids())
def test_a_committed_binding_reads_back_unchanged(db, binding, message_created_at, delivery_id):
    # Every example rolls back its own rows: the test transaction is shared by all of them.
    with transaction.atomic():
        store_the_rows_it_names(binding, message_created_at)
        created = services.commit_deliveries(
            str(binding.community_id), message_created_at, [NewDelivery(delivery_id, binding)]
        )
        record = services.get_delivery(binding.community_id, delivery_id)
        claimed = services.claim_delivery(
            binding.community_id, binding.target_pubkey, expected=binding
        )
        transaction.set_rollback(True)
    assert created == [delivery_id]
    assert record.id == delivery_id
    assert record.binding == binding
    assert record.binding.cause == binding.cause
    assert record.status == DeliveryStatus.PENDING
    assert (record.lease_generation, record.lease_until, record.finished_at) == (0, None, None)
    assert record.message_event_created_at == message_created_at
    assert claimed is not None, "the committed binding, expected in full, must claim its row"
    lease, claimed_record = claimed
    assert (lease.delivery_id, claimed_record.binding) == (delivery_id, binding)
