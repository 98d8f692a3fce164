"""What each operation of the agent API answers an honest agent, in-process
(Django's test client): the claim, renewal, read and finish of one delivery, the claim
and finish batches, the message a delivery carries to its target and to no other agent,
and the OpenAPI document that names every endpoint. The whole lifecycle against a real
server is in test_live.py."""

from __future__ import annotations

import json
from datetime import UTC

import jsonschema_rs
import pytest
from django.db import connection

from tests.api.helpers import Agent, answer, enrolled_secret, rows
from tests.support import factories
from workflow_delivery.models import WorkflowAgentDelivery

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


# -- the happy path, in-process ------------------------------------------------------


def test_claim_renew_get_finish(client, agent):
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    lease, delivery = claimed["lease"], claimed["delivery"]
    assert lease["delivery_id"] == delivery["id"] == str(agent.delivery.id)
    assert lease["target_pubkey"] == delivery["target_pubkey"] == agent.pubkey.hex()
    assert delivery["status"] == "claimed" and lease["generation"] == 1
    assert delivery["cause"] == {"kind": "event", "event_id": agent.step.cause.event_id.hex()}
    assert lease["lease_until"].endswith("Z")

    path = f"v1/deliveries/{lease['delivery_id']}"
    renewed = answer(agent.call(client, "POST", f"{path}/renew", {"generation": 1}), 200)
    assert renewed["lease_until"].endswith("Z")
    assert answer(agent.call(client, "GET", path), 200)["status"] == "claimed"
    finish = {"generation": 1, "outcome": "failed"}
    settled = answer(agent.call(client, "POST", f"{path}/finish", finish), 200)
    assert settled == {"result": "settled", "outcome": "failed"}
    again = answer(
        agent.call(client, "POST", f"{path}/finish", finish | {"outcome": "finished"}), 200
    )
    assert again == {"result": "already_terminal", "status": "failed"}
    assert answer(agent.call(client, "POST", "v1/claim"), 204) is None


def set_delivery(delivery_id, assignment: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE workflow_agent_deliveries SET {assignment} WHERE id = %s", [delivery_id]
        )


def test_a_lease_past_its_lease_until_is_neither_renewed_nor_settled(client, agent):
    """Expired but not yet reaped: still ``claimed``, its generation current, and lost."""
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    path = f"v1/deliveries/{agent.delivery.id}"
    set_delivery(agent.delivery.id, "lease_until = statement_timestamp() - interval '1 second'")
    before = rows()
    generation = claimed["lease"]["generation"]
    answer(
        agent.call(client, "POST", f"{path}/renew", {"generation": generation}), 409, "lease_lost"
    )
    finish = {"generation": generation, "outcome": "finished"}
    answer(agent.call(client, "POST", f"{path}/finish", finish), 409, "lease_lost")
    assert rows() == before
    assert before[0]["status"] == "claimed"


@pytest.mark.parametrize("limit", [None, 5])
def test_a_delivery_backing_off_is_not_claimed_before_its_time(client, agent, limit):
    """A pending delivery whose retry is not yet due: the single claim and the batch
    claim pass it over until ``available_at``."""
    path, document = ("v1/claim", {}) if limit is None else ("v1/claim/batch", {"limit": limit})
    set_delivery(agent.delivery.id, "available_at = statement_timestamp() + interval '1 hour'")
    before = rows()
    answered = answer(agent.call(client, "POST", path, document), 204 if limit is None else 200)
    assert limit is None or answered["claimed"] == []
    assert rows() == before
    set_delivery(agent.delivery.id, "available_at = statement_timestamp() - interval '1 second'")
    answered = answer(agent.call(client, "POST", path, document), 200)
    claimed = answered if limit is None else answered["claimed"][0]
    assert claimed["delivery"]["id"] == str(agent.delivery.id)


def test_claim_with_the_expected_binding_and_with_one_field_off(client, agent):
    from workflow_delivery.wire import binding_document

    expected = binding_document(agent.step.binding(agent.pubkey))
    off = json.loads(json.dumps(expected))
    off["step_id"] = "another-step"
    assert answer(agent.call(client, "POST", "v1/claim", {"expected": off}), 204) is None
    claimed = answer(agent.call(client, "POST", "v1/claim", {"expected": expected}), 200)
    assert claimed["delivery"]["id"] == str(agent.delivery.id)


def test_host_is_matched_without_case_or_port(client, agent):
    response = agent.call(
        client, "GET", f"v1/deliveries/{agent.delivery.id}", host=agent.host.upper() + ":8443"
    )
    assert answer(response, 200)["id"] == str(agent.delivery.id)


def test_openapi_document_is_served_and_names_every_endpoint(client):
    document = answer(client.get("/agents/v1/openapi.json"), 200)
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == {
        "/agents/v1/claim",
        "/agents/v1/claim/batch",
        "/agents/v1/finish/batch",
        "/agents/v1/deliveries/{delivery_id}/renew",
        "/agents/v1/deliveries/{delivery_id}/finish",
        "/agents/v1/deliveries/{delivery_id}/retry",
        "/agents/v1/deliveries/{delivery_id}/release",
        "/agents/v1/deliveries/{delivery_id}/reply",
        "/agents/v1/deliveries/{delivery_id}/replies",
        "/agents/v1/deliveries/{delivery_id}",
        "/agents/v1/wait",
    }
    assert "NostrAuth" in document["components"]["securitySchemes"]


# -- the message, to its target only ---------------------------------------------------


def _message(step: factories.Step) -> dict:
    event = step.message
    return {
        "id": bytes(event.id).hex(),
        "pubkey": bytes(event.pubkey).hex(),
        "created_at": event.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "kind": 9,
        "tags": event.tags,
        "content_kind": "text",
        "content": event.content,
    }


def test_the_claim_and_the_read_carry_the_message_to_its_target(client, agent):
    claimed = answer(agent.call(client, "POST", "v1/claim"), 200)
    assert claimed["delivery"]["message"] == _message(agent.step)
    path = f"v1/deliveries/{agent.delivery.id}"
    assert answer(agent.call(client, "GET", path), 200)["message"] == _message(agent.step)


def test_another_agent_cannot_read_the_message(client, agent):
    other = Agent(owner=agent.step.community)
    path = f"v1/deliveries/{agent.delivery.id}"
    stranger = enrolled_secret(agent.step.community)
    for intruder in ({"secret_key": other.secret}, {"secret_key": stranger}):
        response = agent.call(client, "GET", path, **intruder)
        answer(response, 404, "not_found")
        assert agent.step.message.content.encode() not in response.content
        assert bytes(agent.step.message.id).hex().encode() not in response.content


# -- batches -----------------------------------------------------------------------------


def _more_deliveries(agent: Agent, count: int) -> list:
    steps = [
        factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id=f"more-{n}")
        for n in range(count)
    ]
    return [factories.committed(step)[0] for step in steps]


def test_claim_batch_claims_up_to_the_limit_oldest_first_with_messages(client, agent):
    _more_deliveries(agent, 2)
    claimed = answer(agent.call(client, "POST", "v1/claim/batch", {"limit": 2}), 200)["claimed"]
    assert len(claimed) == 2
    oldest = WorkflowAgentDelivery.objects.order_by("created_at", "id").values_list("id", flat=True)
    assert [item["delivery"]["id"] for item in claimed] == [str(value) for value in oldest[:2]]
    assert all(item["delivery"]["message"]["kind"] == 9 for item in claimed)
    assert all(item["lease"]["generation"] == 1 for item in claimed)
    rest = answer(agent.call(client, "POST", "v1/claim/batch", {"limit": 5}), 200)["claimed"]
    assert len(rest) == 1
    assert answer(agent.call(client, "POST", "v1/claim/batch", {"limit": 5}), 200) == {
        "claimed": []
    }


@pytest.mark.parametrize("limit", [0, 101, "2", None])
def test_claim_batch_refuses_a_bad_limit(client, agent, limit):
    before = rows()
    response = agent.call(client, "POST", "v1/claim/batch", {"limit": limit})
    assert answer(response, 400, "invalid_request")["field"] == "limit"
    assert rows() == before


def test_finish_batch_answers_each_settlement_in_order(client, agent):
    _more_deliveries(agent, 1)
    claimed = answer(agent.call(client, "POST", "v1/claim/batch", {"limit": 2}), 200)["claimed"]
    first, second = (item["lease"] for item in claimed)
    settlements = [
        {"delivery_id": first["delivery_id"], "generation": 1, "outcome": "finished"},
        {"delivery_id": second["delivery_id"], "generation": 7, "outcome": "finished"},
        {"delivery_id": first["delivery_id"], "generation": 1, "outcome": "failed"},
    ]
    results = answer(
        agent.call(client, "POST", "v1/finish/batch", {"settlements": settlements}), 200
    )["results"]
    assert results == [
        {
            "delivery_id": first["delivery_id"],
            "result": "settled",
            "outcome": "finished",
            "status": None,
        },
        {
            "delivery_id": second["delivery_id"],
            "result": "lease_lost",
            "outcome": None,
            "status": None,
        },
        {
            "delivery_id": first["delivery_id"],
            "result": "already_terminal",
            "outcome": None,
            "status": "finished",
        },
    ]
    intruder = {"secret_key": enrolled_secret(agent.step.community)}
    stolen = [{"delivery_id": second["delivery_id"], "generation": 1, "outcome": "failed"}]
    before = rows()
    results = answer(
        agent.call(client, "POST", "v1/finish/batch", {"settlements": stolen}, **intruder), 200
    )["results"]
    assert [item["result"] for item in results] == ["lease_lost"]
    assert rows() == before


# -- answers against the document that describes them -------------------------------------


def _closed(schema: object) -> object:
    """``schema`` with every object closed to keys it does not name, so an answer
    carrying a field the document does not describe fails too."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if closed.get("type") == "object" and "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


def _conforms(openapi: dict, path: str, method: str, document: object) -> None:
    """``document`` is the 200 answer ``openapi`` (closed by ``_closed``) declares."""
    declared = openapi["paths"]["/agents/" + path][method]["responses"]["200"]
    schema = declared["content"]["application/json"]["schema"]
    # The schema's $refs point into the OpenAPI document's components.
    root = {**schema, "components": openapi["components"]}
    errors = [error.message for error in jsonschema_rs.validator_for(root).iter_errors(document)]
    assert not errors, (path, errors)


def test_every_answer_is_what_the_openapi_document_declares(client, agent):
    """The views render the wire documents without running the response models over
    them: each answer must still be exactly the schema its endpoint declares."""
    openapi = _closed(answer(client.get("/agents/v1/openapi.json"), 200))
    _more_deliveries(agent, 1)
    one = "v1/deliveries/{delivery_id}"

    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    _conforms(openapi, "v1/claim", "post", claimed)
    lease = claimed["lease"]
    path = f"v1/deliveries/{lease['delivery_id']}"
    renewed = answer(agent.call(client, "POST", f"{path}/renew", {"generation": 1}), 200)
    _conforms(openapi, f"{one}/renew", "post", renewed)
    _conforms(openapi, one, "get", answer(agent.call(client, "GET", path), 200))
    for outcome in ("failed", "finished"):  # settled, then already terminal
        finish = {"generation": 1, "outcome": outcome}
        settled = answer(agent.call(client, "POST", f"{path}/finish", finish), 200)
        _conforms(openapi, f"{one}/finish", "post", settled)
    # A settled delivery's read carries its finish time and no lease.
    _conforms(openapi, one, "get", answer(agent.call(client, "GET", path), 200))

    batch = answer(agent.call(client, "POST", "v1/claim/batch", {"limit": 5}), 200)
    assert len(batch["claimed"]) == 1
    _conforms(openapi, "v1/claim/batch", "post", batch)
    second = batch["claimed"][0]["lease"]
    settlements = [
        {"delivery_id": second["delivery_id"], "generation": 1, "outcome": "finished"},
        {"delivery_id": second["delivery_id"], "generation": 9, "outcome": "finished"},
        {"delivery_id": lease["delivery_id"], "generation": 1, "outcome": "finished"},
    ]
    results = answer(
        agent.call(client, "POST", "v1/finish/batch", {"settlements": settlements}), 200
    )
    assert [item["result"] for item in results["results"]] == [
        "settled",
        "lease_lost",
        "already_terminal",
    ]
    _conforms(openapi, "v1/finish/batch", "post", results)
