"""The agent API when its database cannot be reached: a real server (uvicorn, and
gunicorn) whose ``DATABASE_URL`` names a port nothing listens on answers every
signed request with a JSON 503 that says to retry, not Django's HTML error page."""

from __future__ import annotations

import http.client
import json
import socket
import uuid
from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest

from tests.support.agent_http import secret
from workflow_delivery.api import nip98
from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import AgentApiError
from workflow_delivery.protocol import Lease, Outcome

pytestmark = pytest.mark.psycopg3  # the servers are started by bench.common (psycopg 3)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module", params=["uvicorn", "gunicorn"])
def server(request):
    from bench import common

    url = f"postgres://root@127.0.0.1:{_closed_port()}/nowhere"
    with common.api_server(
        url, server=request.param, env={"DATABASE_CONNECT_TIMEOUT": "2"}
    ) as base:
        yield base


def test_a_claim_is_answered_503_with_retry_after(server):
    key = secret()
    body = b"{}"
    url = "http://unreachable.example/agents/v1/claim"
    authorization = nip98.sign_request(key, url=url, method="POST", body=body)
    connection = http.client.HTTPConnection("127.0.0.1", urlsplit(server).port, timeout=30)
    try:
        connection.request(
            "POST",
            "/agents/v1/claim",
            body=body,
            headers={
                "Host": "unreachable.example",
                "Authorization": authorization,
                "Content-Type": "application/json",
            },
        )
        response = connection.getresponse()
        answer = response.read()
    finally:
        connection.close()
    assert response.status == 503, answer[:300]
    assert response.getheader("Content-Type", "").startswith("application/json")
    assert int(response.getheader("Retry-After")) >= 1
    assert json.loads(answer)["error"] == "database_unavailable"


def _agent(server: str) -> AgentClient:
    port = urlsplit(server).port
    return AgentClient(
        "http://unreachable.example/agents/",
        secret(),
        timeout=30,
        connect_to=("127.0.0.1", port),
    )


def test_a_claim_through_the_client_raises_the_retryable_error(server):
    with _agent(server) as agent, pytest.raises(AgentApiError) as raised:
        agent.claim(lease_seconds=5)
    assert (raised.value.status, raised.value.code) == (503, "database_unavailable")


def test_a_finish_through_the_client_raises_the_retryable_error(server):
    with _agent(server) as agent, pytest.raises(AgentApiError) as raised:
        lease = Lease(uuid.uuid4(), uuid.uuid4(), agent.pubkey, 1, datetime.now(UTC))
        agent.finish(lease, Outcome.FINISHED)
    assert (raised.value.status, raised.value.code) == (503, "database_unavailable")
