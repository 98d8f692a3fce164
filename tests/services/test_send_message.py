"""``services.send_message``: one call stores the message and one delivery per target,
in one transaction, once per idempotency key, however many callers race."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid

import pytest
from django.db import connection, connections, transaction
from django.test import Client

from tests.support import factories
from tests.support.races import run_together
from workflow_delivery import services
from workflow_delivery.exceptions import (
    CommunityNotFound,
    CommunityWriteFenced,
    IdempotencyConflict,
    MessageTooLarge,
    ProtocolError,
    TargetNotEnrolled,
)
from workflow_delivery.models import (
    Community,
    DeletionState,
    Event,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from workflow_delivery.protocol import (
    MESSAGE_KIND,
    DeliveryStatus,
    EventCause,
    SentMessage,
    WebhookCause,
    message_v1_targets,
)
from workflow_delivery.services import sending

pytestmark = pytest.mark.django_db


def _counts() -> tuple[int, int, int, int]:
    return (
        Workflow.objects.count(),
        WorkflowRun.objects.count(),
        Event.objects.count(),
        WorkflowAgentDelivery.objects.count(),
    )


def _agents(owner: Community, count: int) -> list[bytes]:
    """``count`` new keys enrolled as the community's agents (deliveries go only to those)."""
    keys = [factories.key32() for _ in range(count)]
    factories.enroll(owner, keys)
    return keys


def _send(owner: Community, targets: list[bytes], key: str = "order-1", **options) -> SentMessage:
    options.setdefault("content", "please review")
    return services.send_message(owner.id, targets=targets, idempotency_key=key, **options)


def test_one_call_stores_the_message_and_one_pending_delivery_per_target():
    owner = factories.community()
    targets = _agents(owner, 3)
    sent = _send(owner, targets, tags=[["subject", "invoice 7"]])
    assert sent.created is True
    assert sent.step_id == "order-1"
    assert sent.run_id == sending.run_id_for(owner.id, "order-1")
    assert [r.binding.target_pubkey for r in sent.deliveries] == targets
    assert {r.status for r in sent.deliveries} == {DeliveryStatus.PENDING}
    assert _counts() == (1, 1, 1, 3)
    event = Event.objects.get()
    assert bytes(event.id) == sent.message.id
    assert (event.kind, event.content, bytes(event.pubkey)) == (
        MESSAGE_KIND,
        "please review",
        sending.UNSIGNED_SENDER,
    )
    # The stored message names its targets, its run and step, then the caller's tags.
    assert message_v1_targets(event.kind, event.tags) == targets
    assert ["run", str(sent.run_id), "order-1"] in event.tags
    assert event.tags[-1] == ["subject", "invoice 7"]
    # Its id is the NIP-01 id of its fields.
    serialised = json.dumps(
        [0, event.pubkey.hex(), int(event.created_at.timestamp()), 9, event.tags, event.content],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert sent.message.id == hashlib.sha256(serialised.encode()).digest()
    binding = sent.deliveries[0].binding
    assert binding.workflow_id == sending.workflow_id_for(owner.id)
    assert binding.message_event_id == sent.message.id
    assert binding.definition_event_id == sent.message.id
    assert binding.cause == EventCause(sent.message.id)
    assert sent.deliveries[0].message_event_created_at == event.created_at


def test_the_message_is_found_by_its_run_tag():
    owner = factories.community()
    sent = _send(owner, _agents(owner, 1))
    found = Event.objects.filter(
        community=owner, tags__contains=[["run", str(sent.run_id), sent.step_id]]
    )
    assert [bytes(event.id) for event in found] == [sent.message.id]


def test_the_same_key_again_returns_the_same_deliveries_and_stores_nothing():
    owner = factories.community()
    targets = _agents(owner, 2)
    first = _send(owner, targets)
    again = _send(owner, list(reversed(targets)))
    assert again.created is False
    assert [r.id for r in again.deliveries] == [r.id for r in reversed(first.deliveries)]
    assert again.message == first.message
    assert _counts() == (1, 1, 1, 2)


@pytest.mark.parametrize(
    "tags",
    [
        [["run", "my-pipeline", "stage-2"]],
        [["subject", "x"], ["run", "a", "b"], ["run", "c", "d"]],
        [["run", "same", "twice"], ["run", "same", "twice"]],
    ],
)
def test_a_retry_with_run_tags_of_its_own_returns_the_stored_message(tags):
    owner = factories.community()
    targets = _agents(owner, 2)
    first = _send(owner, targets, tags=tags)
    again = _send(owner, targets, tags=[list(tag) for tag in tags])
    assert again.created is False
    assert again.message == first.message
    assert _counts() == (1, 1, 1, 2)
    with pytest.raises(IdempotencyConflict, match="tags"):
        _send(owner, targets, tags=tags[:-1])
    with pytest.raises(IdempotencyConflict, match="tags"):
        _send(owner, targets, tags=[*tags, ["run", "one", "more"]])


def test_a_retry_naming_the_derived_run_tag_itself_is_another_message():
    owner = factories.community()
    targets = _agents(owner, 1)
    first = _send(owner, targets)
    derived = ["run", str(first.run_id), first.step_id]
    with pytest.raises(IdempotencyConflict, match="tags"):
        _send(owner, targets, tags=[derived])


def test_another_key_is_another_run_in_the_same_workflow():
    owner = factories.community()
    (target,) = _agents(owner, 1)
    first, second = _send(owner, [target], "a"), _send(owner, [target], "b")
    assert first.run_id != second.run_id
    assert first.deliveries[0].binding.workflow_id == second.deliveries[0].binding.workflow_id
    assert _counts() == (1, 2, 2, 2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"content": "something else"}, "content"),
        ({"targets": "more"}, "targets"),
        ({"tags": [["x", "y"]]}, "tags"),
        ({"kind": 1}, "kind"),
        ({"sender": "ab" * 32}, "sender"),
    ],
)
def test_reusing_a_key_for_another_message_is_refused_and_changes_nothing(change, named):
    owner = factories.community()
    (target,) = _agents(owner, 1)
    first = _send(owner, [target])
    before = _counts()
    if change.get("targets") == "more":
        change = {"targets": [target, *_agents(owner, 1)]}
    options = {"targets": [target], **change}
    with pytest.raises(IdempotencyConflict, match=f"'order-1'.*{named}") as caught:
        _send(owner, key="order-1", **options)
    assert caught.value.field == "idempotency_key"
    assert _counts() == before
    assert services.get_delivery(owner.id, first.deliveries[0].id) == first.deliveries[0]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"targets": []}, "targets"),
        ({"targets": "ab" * 32}, "targets"),
        ({"targets": ["zz" * 32]}, "targets"),
        ({"targets": ["ab" * 31]}, "targets"),
        ({"targets": [b"short"]}, "targets"),
        ({"targets": ["ab" * 32, "AB" * 32]}, "targets"),
        ({"targets": [uuid.uuid4().bytes * 2 for _ in range(sending.MAX_TARGETS + 1)]}, "targets"),
        ({"content": object()}, "content"),
        ({"content": float("nan")}, "content"),
        ({"content": 42, "content_kind": "text"}, "content"),
        ({"content": "x", "content_kind": "yaml"}, "content_kind"),
        ({"content": None}, "content"),
        ({"content": "nul\x00"}, "content"),
        ({"content": "\ud800"}, "content"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"idempotency_key": "   "}, "idempotency_key"),
        ({"idempotency_key": "k" * 65}, "idempotency_key"),
        ({"idempotency_key": 7}, "idempotency_key"),
        ({"kind": -1}, "kind"),
        ({"kind": True}, "kind"),
        ({"tags": "x"}, "tags"),
        ({"tags": [["p", "ab" * 32, "", "message-v1"]]}, "tags"),
        ({"tags": [[1]]}, "tags"),
        ({"tags": [[]]}, "tags"),
        ({"sender": "not hex"}, "sender"),
        ({"cause": "webhook"}, "cause"),
        ({"definition_event_id": b"x"}, "definition_event_id"),
        ({"run_id": "not a uuid"}, "run_id"),
        ({"run_id": uuid.uuid4()}, "run_id"),
        ({"workflow_id": uuid.uuid4()}, "workflow_id"),
        ({"message_event_id": bytes(32)}, "message_event_id"),
    ],
)
def test_bad_input_names_the_field_and_stores_nothing(options, field):
    owner = factories.community()
    arguments = {
        "targets": _agents(owner, 1),
        "content": "hello",
        "idempotency_key": "order-1",
        **options,
    }
    with pytest.raises(ProtocolError) as caught:
        services.send_message(owner.id, **arguments)
    assert caught.value.field == field
    assert _counts() == (0, 0, 0, 0)


DEFAULT_BOUNDS = {
    "MAX_MESSAGE_CONTENT_BYTES": 1048576,
    "MAX_MESSAGE_TAGS": 1000,
    "MAX_MESSAGE_TAGS_BYTES": 65536,
}


@pytest.mark.parametrize(
    ("limits", "options", "field", "setting", "size"),
    [
        ({}, {"content": "x" * (1048576 + 1)}, "content", "MAX_MESSAGE_CONTENT_BYTES", 1048577),
        (
            {"MAX_MESSAGE_CONTENT_BYTES": 10},
            {"content": "é" * 6},
            "content",
            "MAX_MESSAGE_CONTENT_BYTES",
            12,
        ),
        ({}, {"tags": [["t", str(n)] for n in range(1001)]}, "tags", "MAX_MESSAGE_TAGS", 1001),
        ({}, {"tags": [["t", "x" * 70000]]}, "tags", "MAX_MESSAGE_TAGS_BYTES", 70010),
        ({"MAX_MESSAGE_TAGS": 2}, {"tags": [["a"], ["b"], ["c"]]}, "tags", "MAX_MESSAGE_TAGS", 3),
        (
            {"MAX_MESSAGE_TAGS_BYTES": 8},
            {"tags": [["abcdefg"]]},
            "tags",
            "MAX_MESSAGE_TAGS_BYTES",
            13,
        ),
    ],
)
def test_a_message_over_a_bound_names_the_limit_and_stores_nothing(
    settings, limits, options, field, setting, size
):
    """Content and tags are bounded by settings (their defaults first); the error names
    the field, the setting and its value, and the size given."""
    for name, value in limits.items():
        setattr(settings, f"WORKFLOW_DELIVERY_{name}", value)
    owner = factories.community()
    targets = _agents(owner, 1)
    with pytest.raises(MessageTooLarge) as caught:
        _send(owner, targets, **options)
    error = caught.value
    assert (error.field, error.setting, error.size) == (
        field, f"WORKFLOW_DELIVERY_{setting}", size,
    )  # fmt: skip
    limit = limits.get(setting, DEFAULT_BOUNDS[setting])
    unit = "tags" if setting == "MAX_MESSAGE_TAGS" else "bytes"
    assert error.limit == limit
    assert str(error) == (
        f"{field}: {size} {unit}, over the limit of {limit} (WORKFLOW_DELIVERY_{setting})"
    )
    assert _counts() == (0, 0, 0, 0)


def test_a_message_at_its_bounds_is_sent(settings):
    settings.WORKFLOW_DELIVERY_MAX_MESSAGE_CONTENT_BYTES = 12
    settings.WORKFLOW_DELIVERY_MAX_MESSAGE_TAGS = 2
    settings.WORKFLOW_DELIVERY_MAX_MESSAGE_TAGS_BYTES = 22
    owner = factories.community()
    sent = _send(owner, _agents(owner, 1), content="é" * 6, tags=[["a", "b"], ["cdefgh"]])
    assert sent.created and sent.message.content == "é" * 6


def test_an_unknown_community_is_named():
    with pytest.raises(CommunityNotFound, match="does not exist"):
        services.send_message(
            uuid.uuid4(), targets=[factories.key32()], content="x", idempotency_key="k"
        )
    assert _counts() == (0, 0, 0, 0)


def test_a_target_that_is_not_an_enrolled_agent_is_refused_and_nothing_is_kept():
    owner = factories.community()
    (agent,) = _agents(owner, 1)
    stranger = factories.key32()
    with pytest.raises(TargetNotEnrolled) as caught:
        _send(owner, [agent, stranger])
    assert caught.value.unknown == (stranger.hex(),)
    # The message, its run and the workflow made for it go with the refused deliveries.
    assert _counts() == (0, 0, 0, 0)


def test_a_fenced_community_refuses_and_keeps_nothing():
    owner = factories.community()
    factories.move_to(owner.id, DeletionState.QUIESCING)
    with pytest.raises(CommunityWriteFenced):
        _send(owner, _agents(owner, 1))
    assert _counts() == (0, 0, 0, 0)


def test_a_failure_after_the_message_rolls_back_the_run_and_the_event(monkeypatch):
    owner = factories.community()

    def refuse(self, created_at, deliveries):
        raise RuntimeError("refused after the event was written")

    monkeypatch.setattr(services.StepIdentity, "commit", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        _send(owner, _agents(owner, 1))
    assert _counts() == (0, 0, 0, 0)


def test_it_sends_in_an_existing_run_and_workflow_with_their_definition():
    step = factories.Step(targets=0)
    definition = factories.key32()
    WorkflowRun.objects.filter(pk=step.run.id).update(definition_event_id=definition)
    (target,) = _agents(step.community, 1)
    sent = services.send_message(
        step.community.id,
        targets=[target],
        content="from the workflow",
        idempotency_key="notify",
        run_id=step.run.id,
        workflow_id=step.workflow.id,
        cause=WebhookCause(uuid.uuid4()),
    )
    binding = sent.deliveries[0].binding
    assert (binding.run_id, binding.workflow_id) == (step.run.id, step.workflow.id)
    assert binding.definition_event_id == definition
    assert binding.cause.kind.value == "webhook"
    with pytest.raises(ProtocolError, match="workflow_id"):
        services.send_message(
            step.community.id,
            targets=[target],
            content="from the workflow",
            idempotency_key="other",
            run_id=step.run.id,
            workflow_id=factories.workflow(step.community).id,
        )


def test_it_sends_an_existing_event_to_its_targets_only():
    step = factories.Step(targets=2)
    event_id = bytes(step.message.id)
    sent = services.send_message(
        step.community.id,
        targets=step.targets,
        idempotency_key="existing",
        message_event_id=event_id,
    )
    assert sent.message.id == event_id and len(sent.deliveries) == 2
    assert Event.objects.count() == 1
    with pytest.raises(ProtocolError, match="not a target") as caught:
        services.send_message(
            step.community.id,
            targets=[factories.key32()],
            idempotency_key="stranger",
            message_event_id=event_id,
        )
    assert caught.value.field == "targets"
    with pytest.raises(ProtocolError, match="as it is"):
        services.send_message(
            step.community.id,
            targets=step.targets,
            content="and new words",
            idempotency_key="mixed",
            message_event_id=event_id,
        )


@pytest.mark.psycopg3  # the API's test helpers import the bench harness (psycopg 3)
def test_each_target_claims_its_delivery_and_reads_the_message(settings):
    from tests.support.agent_http import pubkey, secret, signed

    settings.ALLOWED_HOSTS = ["*"]
    owner = factories.community()
    secrets = [secret(), secret(), secret()]
    factories.enroll(owner, [pubkey(key) for key in secrets])
    sent = _send(owner, [pubkey(key) for key in secrets])
    # In process, by the service.
    _, claimed = services.claim_delivery(owner.id, pubkey(secrets[0]))
    assert claimed.id == sent.deliveries[0].id
    assert services.message_events(owner.id, [claimed])[claimed.id] == sent.message
    # Over the agent API: the claim answers the message, and so does a read.
    for key, record in zip(secrets[1:], sent.deliveries[1:], strict=True):
        answer = signed(Client(), "POST", "v1/claim", {}, host=owner.host, secret_key=key)
        assert answer.status_code == 200
        delivery = answer.json()["delivery"]
        assert delivery["id"] == str(record.id)
        assert delivery["message"]["id"] == sent.message.id.hex()
        assert delivery["message"]["content"] == "please review"
        path = f"v1/deliveries/{record.id}"
        read = signed(Client(), "GET", path, host=owner.host, secret_key=key)
        assert read.json()["message"] == delivery["message"]
    assert {services.get_delivery(owner.id, r.id).status for r in sent.deliveries} == {
        DeliveryStatus.CLAIMED
    }


@pytest.mark.django_db(transaction=True)
def test_a_second_caller_waits_for_the_first_and_gets_its_deliveries():
    """Deterministic: the first caller's transaction holds the step's identity lock
    while the second calls; the second returns only once the first commits."""
    owner = factories.community()
    targets = _agents(owner, 2)
    first_sent, release = threading.Event(), threading.Event()
    results: dict[str, SentMessage] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                results["first"] = _send(owner, targets)
                first_sent.set()
                assert release.wait(30)
        finally:
            connection.close()

    def second() -> None:
        try:
            results["second"] = _send(owner, targets)
        finally:
            connection.close()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_sent.wait(30)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    observer = connections.create_connection("default")
    try:
        assert _eventually(lambda: _waiting_on_a_lock(observer))
        assert "second" not in results
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
        observer.close()
    assert results["first"].created is True and results["second"].created is False
    assert [r.id for r in results["second"].deliveries] == [
        r.id for r in results["first"].deliveries
    ]
    assert _counts() == (1, 1, 1, 2)


@pytest.mark.django_db(transaction=True)
def test_two_threads_racing_with_one_key_make_one_message():
    owner = factories.community()
    targets = _agents(owner, 3)
    results = run_together(2, lambda _: _send(owner, targets))
    assert sorted(result.created for result in results) == [False, True]
    assert {tuple(r.id for r in result.deliveries) for result in results} == {
        tuple(r.id for r in results[0].deliveries)
    }
    assert _counts() == (1, 1, 1, 3)


@pytest.mark.django_db(transaction=True)
def test_first_sends_with_different_keys_racing_make_one_workflow():
    owner = factories.community()
    keys = ("a", "b")
    agents = dict(zip(keys, _agents(owner, 2), strict=True))
    # Either send raising fails the test here, with its own traceback.
    run_together(2, lambda index: _send(owner, [agents[keys[index]]], keys[index]))
    assert _counts() == (1, 2, 2, 2)


def _waiting_on_a_lock(observer) -> bool:
    with observer.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return cursor.fetchone()[0] > 0


def _eventually(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _plant_workflow(intruder: Community, workflow_id: uuid.UUID) -> Workflow:
    return Workflow.objects.create(
        id=workflow_id, community=intruder, name="planted", owner_pubkey=bytes(32), definition={}
    )


def _plant_run(intruder: Community, run_id: uuid.UUID) -> WorkflowRun:
    return WorkflowRun.objects.create(
        id=run_id, community=intruder, workflow=factories.workflow(intruder)
    )


def test_another_communitys_rows_on_the_derived_ids_do_not_stop_its_sends():
    owner, intruder = factories.community(), factories.community()
    targets = _agents(owner, 2)
    _plant_workflow(intruder, sending.workflow_id_for(owner.id))
    _plant_run(intruder, sending.run_id_for(owner.id, "order-1"))
    _plant_run(intruder, sending.run_id_for(owner.id, "order-1", 1))
    first = _send(owner, targets)
    assert first.created is True
    assert first.run_id == sending.run_id_for(owner.id, "order-1", 2)
    assert first.deliveries[0].binding.workflow_id == sending.workflow_id_for(owner.id, 1)
    again = _send(owner, targets)
    assert again.created is False
    assert [r.id for r in again.deliveries] == [r.id for r in first.deliveries]
    other = _send(owner, targets, key="order-2")
    assert other.run_id == sending.run_id_for(owner.id, "order-2")
    assert other.deliveries[0].binding.workflow_id == first.deliveries[0].binding.workflow_id
    assert WorkflowRun.objects.filter(community=intruder).count() == 2


def test_a_retry_finds_its_run_after_the_id_before_it_is_freed():
    owner, intruder = factories.community(), factories.community()
    targets = _agents(owner, 1)
    planted = _plant_run(intruder, sending.run_id_for(owner.id, "order-1"))
    first = _send(owner, targets)
    planted.delete()
    again = _send(owner, targets)
    assert (again.created, again.run_id) == (False, first.run_id)
    assert [r.id for r in again.deliveries] == [r.id for r in first.deliveries]


def test_a_send_stored_on_the_first_derived_id_is_found_by_its_retry():
    """What every send made before ids were derived in turn looks like."""
    owner = factories.community()
    targets = _agents(owner, 1)
    first = _send(owner, targets)
    assert first.run_id == sending.run_id_for(owner.id, "order-1")
    assert first.deliveries[0].binding.workflow_id == sending.workflow_id_for(owner.id)
    assert _send(owner, targets).created is False


def test_every_derived_run_id_taken_is_a_clear_error_that_keeps_nothing():
    owner, intruder = factories.community(), factories.community()
    targets = _agents(owner, 1)
    for attempt in range(sending.DERIVED_IDS):
        _plant_run(intruder, sending.run_id_for(owner.id, "order-1", attempt))
    before = _counts()
    with pytest.raises(IdempotencyConflict, match="another community's run") as caught:
        _send(owner, targets)
    assert caught.value.field == "idempotency_key"
    assert _counts() == before
    assert _send(owner, targets, key="order-2").created is True
