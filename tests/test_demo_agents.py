"""The demo's agent identities (signing keys whose public keys are the targets) and
AgentClient's connect_to option: an address to connect to while the Host and the
signed URL stay those of the base URL."""

from __future__ import annotations

import pytest

from buzz_project.demo import data as demo
from workflow_delivery.api import nip98
from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import Community, WorkflowAgentDelivery

ALPHA = "alpha.demo.buzz"


@pytest.fixture
def alpha(transactional_db) -> Community:
    demo.load_demo_data()
    return Community.objects.get(host=ALPHA)


def test_demo_targets_are_the_public_keys_of_the_agents_secret_keys(alpha):
    for host in demo.HOSTS:
        keys = [nip98.public_key(demo.agent_secret(host, name)) for name in demo.AGENTS]
        assert demo.agent_pubkeys(host) == keys
    targets = set(WorkflowAgentDelivery.objects.values_list("target_pubkey", flat=True))
    assert {bytes(t) for t in targets} == {k for h in demo.HOSTS for k in demo.agent_pubkeys(h)}


@pytest.mark.parametrize(
    ("base_url", "connect_to", "message"),
    [
        ("http://a.example/", ("127.0.0.1", 0), "port must be 1 to 65535"),
        ("http://a.example/", ("127.0.0.1", "80"), "port must be 1 to 65535"),
        ("http://a.example/", ("", 80), "address must be"),
        ("http://a.example/", "127.0.0.1:80", r"an \(address, port\) pair"),
        ("https://a.example/", ("127.0.0.1", 443), "http:// base_url only"),
    ],
)
def test_agent_client_refuses_a_bad_connect_to(base_url, connect_to, message):
    with pytest.raises(ProtocolError, match=message) as refused:
        AgentClient(base_url, bytes(range(1, 33)), connect_to=connect_to)
    assert refused.value.field == "connect_to"
