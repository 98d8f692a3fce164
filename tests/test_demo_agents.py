"""AgentClient's connect_to option: an address to connect to while the Host and the
signed URL stay those of the base URL."""

from __future__ import annotations

import pytest

from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import ProtocolError


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
