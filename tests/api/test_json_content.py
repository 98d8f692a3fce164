"""A message whose content is a JSON value, over the agent API: every answer that
carries the message (claim, claim by expected binding, batch claim, read) gives the
value as JSON with ``content_kind`` ``json``, a text message stays a string, the
OpenAPI document says so, and ``AgentClient`` against a live server returns the value."""

from __future__ import annotations

import jsonschema_rs
import pytest

from tests.api.helpers import answer
from tests.support import factories
from tests.support.agent_http import pubkey, secret
from workflow_delivery import services, wire
from workflow_delivery.client import AgentClient
from workflow_delivery.protocol import ContentKind, SentMessage

ORDER = {"order": 17, "items": [{"sku": "A-1", "qty": 2}], "paid": False, "note": None}


class _Sender:
    """An agent key enrolled in a fresh community, and messages sent to it."""

    def __init__(self) -> None:
        self.secret = secret()
        self.owner = factories.community()
        factories.enroll(self.owner, [pubkey(self.secret)])

    def send(self, key: str, content, **options) -> SentMessage:
        return services.send_message(
            self.owner.id,
            targets=[pubkey(self.secret)],
            idempotency_key=key,
            content=content,
            **options,
        )

    def call(self, client, method: str, path: str, document=None):
        from tests.support.agent_http import signed

        return signed(client, method, path, document, host=self.owner.host, secret_key=self.secret)


def _client(live_server, host: str, key: bytes) -> AgentClient:
    port = int(live_server.url.rsplit(":", 1)[1])
    return AgentClient(
        f"http://{host}:{port}/agents/", key, connect_to=("127.0.0.1", port), timeout=10
    )


def _message_schema(client) -> dict:
    document = answer(client.get("/agents/v1/openapi.json"), 200)
    return {**document["components"]["schemas"]["MessageOut"], "components": document["components"]}


@pytest.mark.django_db
@pytest.mark.usefixtures("any_host")
def test_every_answer_carrying_the_message_gives_the_json_value(client):
    sender = _Sender()
    sent = [
        sender.send("json-1", ORDER),
        sender.send("text", "plain words"),
        sender.send("json-2", [1, "two", 3.5]),
        sender.send("json-3", "a JSON string", content_kind="json"),
    ]
    schema = jsonschema_rs.validator_for(_message_schema(client))

    def checked(delivery: dict, expected: SentMessage) -> None:
        message = delivery["message"]
        assert message["id"] == expected.message.id.hex()
        assert message["content_kind"] == expected.message.content_kind.value
        assert message["content"] == expected.message.content
        assert list(schema.iter_errors(message)) == []

    claimed = answer(sender.call(client, "POST", "v1/claim", {}), 200)["delivery"]
    checked(claimed, sent[0])
    assert claimed["message"]["content"] == ORDER
    assert claimed["message"]["content_kind"] == "json"

    expected = wire.binding_document(sent[1].deliveries[0].binding)
    by_binding = answer(sender.call(client, "POST", "v1/claim", {"expected": expected}), 200)
    checked(by_binding["delivery"], sent[1])
    assert by_binding["delivery"]["message"]["content"] == "plain words"
    assert by_binding["delivery"]["message"]["content_kind"] == "text"

    batch = answer(sender.call(client, "POST", "v1/claim/batch", {"limit": 5}), 200)
    assert len(batch["claimed"]) == 2
    for item, expected_sent in zip(batch["claimed"], sent[2:], strict=True):
        checked(item["delivery"], expected_sent)

    read = answer(sender.call(client, "GET", f"v1/deliveries/{claimed['id']}"), 200)
    checked(read, sent[0])


@pytest.mark.django_db
def test_the_openapi_document_says_content_is_any_json_value_by_its_kind(client):
    message = answer(client.get("/agents/v1/openapi.json"), 200)["components"]["schemas"][
        "MessageOut"
    ]
    assert {"content_kind", "content"} <= set(message["required"])
    assert message["properties"]["content_kind"]["enum"] == ["text", "json"]
    content = message["properties"]["content"]
    assert "type" not in content and "$ref" not in content  # any JSON value
    assert "JSON value" in content["description"]
    validator = jsonschema_rs.validator_for({"type": "object", "properties": {"c": content}})
    for value in (ORDER, [1], "text", 1.5, True, None):
        assert validator.is_valid({"c": value})


@pytest.mark.django_db(transaction=True)
def test_the_agent_client_returns_the_json_value(live_server, settings):
    settings.ALLOWED_HOSTS = ["*"]
    sender = _Sender()
    json_sent = sender.send("json", ORDER)
    text_sent = sender.send("text", "plain words")
    with _client(live_server, sender.owner.host, sender.secret) as agent:
        first = agent.claim(lease_seconds=30)
        assert first.message == json_sent.message
        assert first.message.content_kind is ContentKind.JSON
        assert first.message.content == ORDER
        assert agent.message(first.record.id) == json_sent.message
        (second,) = agent.claim_many(5, lease_seconds=30)
        assert second.message == text_sent.message
        assert (second.message.content_kind, second.message.content) == (
            ContentKind.TEXT,
            "plain words",
        )


def test_a_message_document_without_a_content_kind_is_text():
    """An answer from a server whose messages are text only."""
    document = {
        "id": "ab" * 32,
        "pubkey": "cd" * 32,
        "created_at": "2026-01-01T00:00:00Z",
        "kind": 9,
        "tags": [],
        "content": "hello",
    }
    message = wire.parse_message(document)
    assert (message.content_kind, message.content) == (ContentKind.TEXT, "hello")
    assert wire.message_document(message) == {**document, "content_kind": "text"}
