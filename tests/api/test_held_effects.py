"""The endpoints of a held delivery beyond renew and finish (reply, replies, retry,
release, finish with a reason) follow the rules of the others: only the lease's own
key reaches them, in the community its Host names; a refused request keeps nothing,
its replay row included; an accepted one cannot be replayed; a revoked key is
refused and changes nothing."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.api.helpers import Agent, answer, enrolled_secret, rows
from tests.support import factories
from tests.support.agent_http import pubkey
from workflow_delivery.api import nip98
from workflow_delivery.models import AgentRequestReplay, Event, WorkflowAgentDelivery
from workflow_delivery.services import revoke_agent

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


def claim(client, agent: Agent) -> tuple[str, int]:
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    return f"v1/deliveries/{agent.delivery.id}", claimed["lease"]["generation"]


def effects(generation: int, peer: bytes) -> list[tuple[str, dict]]:
    """Each write beyond renew and finish, as (path suffix, body)."""
    reply = {"content": "hi", "to": [peer.hex()], "idempotency_key": "k"}
    return [
        ("reply", {"generation": generation} | reply),
        ("retry", {"generation": generation, "error": "it died"}),
        ("release", {"generation": generation}),
        ("finish", {"generation": generation, "outcome": "failed", "error": "no"}),
    ]


def test_another_agents_lease_reaches_nothing(client, agent):
    path, generation = claim(client, agent)
    peer = pubkey(enrolled_secret(agent.step.community))
    intruder = enrolled_secret(agent.step.community)
    before, events = rows(), Event.objects.count()
    for suffix, body in effects(generation, peer):
        sent = agent.call(client, "POST", f"{path}/{suffix}", body, secret_key=intruder)
        answer(sent, 409, "lease_lost")
    listed = agent.call(client, "GET", f"{path}/replies", secret_key=intruder)
    answer(listed, 404, "not_found")
    assert rows() == before and Event.objects.count() == events
    # Refused, each kept no replay row: only the claim's.
    assert AgentRequestReplay.objects.count() == 1


def test_a_stale_generation_reaches_nothing(client, agent):
    path, generation = claim(client, agent)
    peer = pubkey(enrolled_secret(agent.step.community))
    before, events = rows(), Event.objects.count()
    for suffix, body in effects(generation + 1, peer):
        answer(agent.call(client, "POST", f"{path}/{suffix}", body), 409, "lease_lost")
    assert rows() == before and Event.objects.count() == events


def test_an_accepted_reply_cannot_be_replayed(client, agent):
    path, generation = claim(client, agent)
    peer = pubkey(enrolled_secret(agent.step.community))
    suffix, document = effects(generation, peer)[0]
    body = json.dumps(document).encode()
    url = f"http://{agent.host}/agents/{path}/{suffix}"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
    sent = answer(agent.call(client, "POST", f"{path}/reply", raw=body, authorization=header), 200)
    assert sent["created"] is True and len(sent["deliveries"]) == 1
    again = agent.call(client, "POST", f"{path}/reply", raw=body, authorization=header)
    answer(again, 401, "auth_replay")
    assert WorkflowAgentDelivery.objects.filter(target_pubkey=peer).count() == 1
    # A new signature of the same reply: sent once, what a retry sees.
    retried = answer(agent.call(client, "POST", f"{path}/reply", document), 200)
    assert retried["created"] is False and retried["message_id"] == sent["message_id"]
    listed = answer(agent.call(client, "GET", f"{path}/replies"), 200)
    assert [item["id"] for item in listed["replies"]] == [sent["message_id"]]


def test_a_revoked_key_is_refused_and_changes_nothing(client, agent):
    path, generation = claim(client, agent)
    peer = pubkey(enrolled_secret(agent.step.community))
    revoke_agent(agent.step.community.id, agent.pubkey)
    before, events = rows(), Event.objects.count()
    for suffix, body in effects(generation, peer):
        answer(agent.call(client, "POST", f"{path}/{suffix}", body), 401, "auth_revoked")
    assert rows() == before and Event.objects.count() == events


def test_bad_replies_are_refused_by_field_and_store_nothing(client, agent, settings):
    settings.WORKFLOW_DELIVERY_ACP_REPLY_BYTES = 10
    path, generation = claim(client, agent)
    peer = pubkey(enrolled_secret(agent.step.community))
    events = Event.objects.count()
    base = {"generation": generation, "content": "hi", "to": [peer.hex()], "idempotency_key": "k"}
    for change, field, code in [
        ({"content": "far more than ten bytes"}, "content", "invalid_request"),
        ({"content": ""}, "content", "invalid_request"),
        ({"to": []}, "to", "invalid_request"),
        ({"to": ["AB" * 32]}, "to.0", "invalid_request"),
        ({"to": [factories.key32().hex()]}, "to", "target_not_enrolled"),
        ({"idempotency_key": "x" * 201}, "idempotency_key", "invalid_request"),
    ]:
        refused = answer(agent.call(client, "POST", f"{path}/reply", base | change), 400, code)
        assert refused["field"] == field, refused
    assert Event.objects.count() == events
    assert AgentRequestReplay.objects.count() == 1


def test_a_missing_delivery_has_no_replies(client, agent):
    answer(agent.call(client, "GET", f"v1/deliveries/{uuid.uuid4()}/replies"), 404, "not_found")
