"""A message whose content is a JSON value: ``send_message`` stores it as ``jsonb``
beside its encoding, the services, the consumer's handler and the admin give it back
as JSON, a retry is compared as ``jsonb`` compares, and bad values are refused before
anything is stored. Text content is unchanged."""

from __future__ import annotations

import hashlib
import json
import threading
from decimal import Decimal

import pytest
from django.db import DataError, IntegrityError, connection, transaction

from tests.support import factories
from tests.support.admin_pages import change
from tests.support.consumers import Recorder, Running, eventually
from workflow_delivery import services
from workflow_delivery.consumer import Consumer
from workflow_delivery.content import MAX_JSON_DEPTH, content_size, encode_content
from workflow_delivery.exceptions import IdempotencyConflict, ProtocolError
from workflow_delivery.models import Community, Event, WorkflowAgentDelivery
from workflow_delivery.protocol import ContentKind, SentMessage

ORDER = {"order": 17, "items": [{"sku": "A-1", "qty": 2, "price": 9.5}], "note": "café ☕"}


def _counts() -> tuple[int, int]:
    return Event.objects.count(), WorkflowAgentDelivery.objects.count()


def _agents(owner: Community, count: int = 1) -> list[bytes]:
    keys = [factories.key32() for _ in range(count)]
    factories.enroll(owner, keys)
    return keys


def _send(owner: Community, targets: list[bytes], key: str = "order-17", **options) -> SentMessage:
    options.setdefault("content", ORDER)
    return services.send_message(owner.id, targets=targets, idempotency_key=key, **options)


def _stored(sent: SentMessage) -> tuple[str, object, bool]:
    """The event's ``content`` text, its jsonb value as text, and whether jsonb is NULL."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT content, content_json::text, content_json IS NULL FROM events WHERE id = %s",
            [sent.message.id],
        )
        return cursor.fetchone()


@pytest.mark.django_db
class TestSending:
    def test_a_json_value_is_stored_as_jsonb_and_returned_as_the_value(self):
        owner = factories.community()
        targets = _agents(owner, 2)
        sent = _send(owner, targets)
        assert sent.message.content_kind is ContentKind.JSON
        assert sent.message.content == ORDER
        text, as_jsonb, is_null = _stored(sent)
        assert not is_null
        assert json.loads(as_jsonb) == ORDER
        # The text beside it is the compact encoding, which the event's NIP-01 id covers.
        assert text == json.dumps(ORDER, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        event = Event.objects.get()
        serialised = json.dumps(
            [0, event.pubkey.hex(), int(event.created_at.timestamp()), 9, event.tags, text],
            separators=(",", ":"),
            ensure_ascii=False,
        )
        assert sent.message.id == hashlib.sha256(serialised.encode()).digest()
        # Each delivery's message, read by the service, is the same JSON value.
        for record in sent.deliveries:
            assert services.message_events(owner.id, [record])[record.id] == sent.message

    def test_text_stays_the_default_and_is_stored_as_before(self):
        owner = factories.community()
        sent = _send(owner, _agents(owner), content='{"looks": "like json"}')
        assert sent.message.content_kind is ContentKind.TEXT
        assert sent.message.content == '{"looks": "like json"}'
        assert _stored(sent) == ('{"looks": "like json"}', None, True)
        (record,) = sent.deliveries
        assert services.message_events(owner.id, [record])[record.id] == sent.message

    def test_a_row_stored_before_json_content_reads_as_text(self, step):
        # factories write events as every earlier version did: content only.
        record = services.get_delivery(step.community.id, factories.committed(step)[0].id)
        message = services.message_events(step.community.id, [record])[record.id]
        assert (message.content_kind, message.content) == (ContentKind.TEXT, step.message.content)

    @pytest.mark.parametrize(
        "value", ["a JSON string", None, 0, -1.5, True, [], {}, [None, [[]]], 10**40]
    )
    def test_any_json_value_makes_the_round_trip(self, value):
        owner = factories.community()
        sent = _send(owner, _agents(owner), content=value, content_kind="json")
        assert sent.message.content_kind is ContentKind.JSON
        assert sent.message.content == value
        (record,) = sent.deliveries
        assert services.message_events(owner.id, [record])[record.id] == sent.message
        assert json.loads(_stored(sent)[1]) == value

    def test_a_retry_equal_as_jsonb_returns_the_stored_result(self):
        owner = factories.community()
        targets = _agents(owner)
        first = _send(owner, targets)
        reordered = {
            "note": "café ☕",
            "items": [{"qty": 2.0, "price": 9.50, "sku": "A-1"}],
            "order": 17,
        }
        again = _send(owner, targets, content=reordered)
        assert again.created is False
        assert again.message == first.message
        assert [r.id for r in again.deliveries] == [r.id for r in first.deliveries]
        assert _counts() == (1, 1)

    def test_a_json_null_retry_returns_the_stored_result(self):
        owner = factories.community()
        targets = _agents(owner)
        first = _send(owner, targets, content=None, content_kind="json")
        again = _send(owner, targets, content=None, content_kind="json")
        assert (again.created, again.message) == (False, first.message)
        with pytest.raises(IdempotencyConflict, match="content"):
            _send(owner, targets, content=False)

    @pytest.mark.parametrize(
        "other",
        [
            {**ORDER, "order": 18},
            {**ORDER, "extra": None},
            {key: value for key, value in ORDER.items() if key != "note"},
            {**ORDER, "items": [{"sku": "A-1", "qty": "2", "price": 9.5}]},
            [ORDER],
            json.dumps(ORDER, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
        ],
        ids=["value", "added-key", "missing-key", "number-as-string", "wrapped", "as-text"],
    )
    def test_a_retry_with_another_value_conflicts_and_changes_nothing(self, other):
        owner = factories.community()
        targets = _agents(owner)
        first = _send(owner, targets)
        with pytest.raises(IdempotencyConflict, match=r"'order-17'.*content") as caught:
            _send(owner, targets, content=other)
        assert caught.value.field == "idempotency_key"
        assert _counts() == (1, 1)
        assert services.get_delivery(owner.id, first.deliveries[0].id) == first.deliveries[0]
        assert json.loads(_stored(first)[1]) == ORDER

    def test_text_sent_first_conflicts_with_the_same_words_as_a_json_string(self):
        owner = factories.community()
        targets = _agents(owner)
        _send(owner, targets, content="hello")
        with pytest.raises(IdempotencyConflict, match="content"):
            _send(owner, targets, content="hello", content_kind="json")

    @pytest.mark.parametrize(
        ("content", "kind", "named"),
        [
            (float("nan"), None, "NaN"),
            ({"a": [1, float("inf")]}, None, r"content\['a'\]\[1\].*infinity"),
            ({"when": Decimal("1.5")}, None, r"content\['when'\] is a Decimal"),
            ({1: "a"}, None, "key 1.*strings"),
            ({"b": b"bytes"}, None, "bytes, which is not a JSON value"),
            ({"s": {1, 2}}, None, "set"),
            ({"nul": "a\x00b"}, None, "NUL"),
            (["\ud800"], None, "surrogate"),
            (10**5000, None, "not JSON-serialisable"),
            ("text", "xml", "'text' or 'json'"),
            ({"a": 1}, "text", "must be a string, not dict"),
            (None, None, "must be given"),
        ],
        ids=[
            "nan",
            "infinity",
            "decimal",
            "int-key",
            "bytes",
            "set",
            "nul",
            "surrogate",
            "huge-int",
            "unknown-kind",
            "dict-as-text",
            "none",
        ],
    )
    def test_bad_content_is_named_and_nothing_is_stored(self, content, kind, named):
        owner = factories.community()
        targets = _agents(owner)
        with pytest.raises(ProtocolError, match=named) as caught:
            _send(owner, targets, content=content, content_kind=kind)
        assert caught.value.field == ("content_kind" if kind == "xml" else "content")
        assert _counts() == (0, 0)

    def test_a_value_deeper_than_the_limit_or_containing_itself_is_refused(self):
        owner = factories.community()
        targets = _agents(owner)
        deep: list = []
        for _ in range(MAX_JSON_DEPTH):
            deep = [deep]
        with pytest.raises(ProtocolError, match=f"deeper than {MAX_JSON_DEPTH}"):
            _send(owner, targets, content=deep)
        looped: dict = {}
        looped["self"] = looped
        with pytest.raises(ProtocolError, match="contains itself"):
            _send(owner, targets, content=looped)
        assert _counts() == (0, 0)
        # One level less is stored.
        assert _send(owner, targets, content=deep[0]).message.content == deep[0]

    def test_an_existing_event_is_sent_without_a_content_kind(self):
        step = factories.Step(targets=1)
        with pytest.raises(ProtocolError, match="as it is"):
            services.send_message(
                step.community.id,
                targets=step.targets,
                idempotency_key="existing",
                message_event_id=bytes(step.message.id),
                content_kind="json",
            )


def test_the_stored_size_is_the_encodings_utf8_length():
    assert content_size("héllo") == 6
    assert content_size({"b": 1, "a": "é"}) == len('{"a":"é","b":1}'.encode())
    assert content_size("héllo", "json") == len('"héllo"'.encode())
    assert content_size(None, "json") == 4
    assert encode_content({"b": [1, 2]}) == (ContentKind.JSON, '{"b":[1,2]}')
    with pytest.raises(ProtocolError, match="NaN"):
        content_size([float("nan")])


def _insert(raw, content: str, content_json: str | None) -> bytes:
    event_id = factories.key32()
    raw.execute(
        "INSERT INTO events (id, community_id, created_at, kind, pubkey, content, content_json, "
        "tags) VALUES (%s, %s, now(), 9, %s, %s, %s::jsonb, '[]')",
        [event_id, factories.community().id, factories.key32(), content, content_json],
    )
    return event_id


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("content", "content_json"),
    [('{"a":1}', '{"a":2}'), ('{"a":1}', '"{\\"a\\":1}"'), ("null", "0"), ("[]", "{}")],
)
def test_postgresql_refuses_a_json_value_that_is_not_the_content(raw, content, content_json):
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        _insert(raw, content, content_json)
    assert caught.value.__cause__.diag.constraint_name == "wd_event_content_json_is_content"


@pytest.mark.django_db
@pytest.mark.parametrize("content", ["plain words", ""])
def test_postgresql_refuses_a_json_value_beside_content_that_is_not_json(raw, content):
    # The CHECK parses the text as jsonb: text that is no JSON fails that parse.
    refused = pytest.raises(DataError, match="invalid input syntax for type json")
    with refused, transaction.atomic():
        _insert(raw, content, '"plain words"')
    assert not Event.objects.filter(content=content).exists()


@pytest.mark.django_db
def test_postgresql_takes_equal_values_spelled_differently_and_text_alone(raw):
    spelled = _insert(raw, '{"b": [1.0], "a": 2}', '{"a":2,"b":[1]}')
    text = _insert(raw, "plain words", None)
    stored = dict(Event.objects.filter(id__in=[spelled, text]).values_list("id", "content_json"))
    assert {bytes(key): value for key, value in stored.items()} == {
        spelled: {"a": 2, "b": [1]},
        text: None,
    }


@pytest.mark.django_db(transaction=True)
def test_the_consumers_handler_reads_the_json_value_from_its_context():
    owner = factories.community()
    targets = _agents(owner, 2)
    json_sent = _send(owner, targets[:1])
    text_sent = _send(owner, targets[1:], key="hello", content="hello")
    seen: dict = {}
    lock = threading.Lock()

    def body(record, lease, context):
        message = context.message
        with lock:
            seen[record.binding.target_pubkey] = (message.content_kind, message.content)
        assert context.message is message  # read once

    handler = Recorder(body)
    consumer = Consumer(
        owner.id, targets, handler, lease_seconds=5, listen=False, poll_interval=0.1
    )
    with Running(consumer) as running:
        assert eventually(lambda: len(seen) == 2, 10)
    assert running.stats.finished == 2
    assert seen == {
        targets[0]: (ContentKind.JSON, ORDER),
        targets[1]: (ContentKind.TEXT, "hello"),
    }
    assert json_sent.message.content == ORDER and text_sent.message.content == "hello"


@pytest.mark.django_db
def test_the_admin_shows_a_json_value_indented_and_text_as_it_is(admin_client):
    owner = factories.community()
    targets = _agents(owner)
    sent = _send(owner, targets, content={"b": [1, {"c": "<x>"}], "a": "é"})
    page = admin_client.get(change(Event, sent.message.id.hex())).content.decode()
    shown = json.dumps({"a": "é", "b": [1, {"c": "&lt;x&gt;"}]}, indent=2, ensure_ascii=False)
    assert f'<pre class="wd-json">{shown.replace(chr(34), "&quot;")}</pre>' in page
    text = _send(owner, targets, key="text", content="line one <b>")
    page = admin_client.get(change(Event, text.message.id.hex())).content.decode()
    assert "line one &lt;b&gt;" in page and "wd-json" not in page
