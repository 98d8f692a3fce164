"""What a properly signed request can reach: the deliveries of its own key, in the
community its Host names, and nothing else. Another agent's delivery answers as a
missing one and its lease is useless, a Host that names no community (or only
resembles one) is a 404, a fenced community a 409, and none of them changes a row."""

from __future__ import annotations

import uuid

import pytest

from tests.api.helpers import Agent, answer, enrolled_secret, rows
from tests.support import factories
from workflow_delivery.models import AgentRequestReplay

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


def test_another_agents_delivery_is_invisible_and_its_lease_useless(client, agent):
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    generation = claimed["lease"]["generation"]
    before = rows()
    intruder = enrolled_secret(agent.step.community)
    path = f"v1/deliveries/{agent.delivery.id}"
    as_intruder = {"secret_key": intruder}
    missing = answer(agent.call(client, "GET", f"v1/deliveries/{uuid.uuid4()}"), 404, "not_found")
    foreign = answer(agent.call(client, "GET", path, **as_intruder), 404, "not_found")
    assert foreign == missing
    by_id = {"delivery_id": str(agent.delivery.id)}
    assert answer(agent.call(client, "POST", "v1/claim", by_id, **as_intruder), 204) is None
    copied = {"generation": generation}
    answer(agent.call(client, "POST", f"{path}/renew", copied, **as_intruder), 409, "lease_lost")
    finish = copied | {"outcome": "finished"}
    answer(agent.call(client, "POST", f"{path}/finish", finish, **as_intruder), 409, "lease_lost")
    assert rows() == before


def test_another_community_through_the_host_header(client, agent):
    elsewhere = factories.community()
    # An agent of both: only the Host decides which community it is served in.
    factories.enroll(elsewhere, [agent.pubkey])
    before = rows()
    path = f"v1/deliveries/{agent.delivery.id}"
    answer(agent.call(client, "GET", path, host=elsewhere.host), 404, "not_found")
    by_id = {"delivery_id": str(agent.delivery.id)}
    assert answer(agent.call(client, "POST", "v1/claim", by_id, host=elsewhere.host), 204) is None
    assert rows() == before


@pytest.mark.parametrize("shape", ["{host}.evil", "{label}", "x{host}", "{host}-2"])
def test_a_host_that_only_resembles_a_community_is_unknown(client, agent, shape):
    before = rows()
    host = shape.format(host=agent.host, label=agent.host.split(".")[0])
    response = agent.call(client, "POST", "v1/claim", host=host)
    answer(response, 404, "unknown_community")
    assert rows() == before
    assert not AgentRequestReplay.objects.exists()


def test_claim_of_another_agents_pending_delivery_by_id_is_a_miss(client, agent):
    intruder = Agent(owner=agent.step.community)
    before = rows()
    by_id = {"delivery_id": str(agent.delivery.id), "lease_seconds": 30}
    assert answer(intruder.call(client, "POST", "v1/claim", by_id), 204) is None
    assert rows() == before
    mine = answer(agent.call(client, "POST", "v1/claim", by_id), 200)
    assert mine["delivery"]["id"] == str(agent.delivery.id)


def test_unknown_host_is_404(client, agent):
    before = rows()
    response = agent.call(client, "POST", "v1/claim", host="nobody.example")
    answer(response, 404, "unknown_community")
    assert rows() == before


@pytest.mark.parametrize("state", ["quiescing", "fenced"])
def test_fenced_community_answers_409(client, agent, state):
    factories.move_to(agent.step.community.id, state)
    before = rows()
    answer(agent.call(client, "POST", "v1/claim"), 409, "community_fenced")
    answer(agent.call(client, "GET", f"v1/deliveries/{agent.delivery.id}"), 409, "community_fenced")
    assert rows() == before
