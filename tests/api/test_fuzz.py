"""Fuzzing the agent API from the OpenAPI document it serves (schemathesis), against a
real uvicorn server: every request properly signed, so the fuzz reaches the views,
and no answer may be a server error. Bounded: a few dozen examples per operation."""

from __future__ import annotations

from collections import Counter

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.support import factories
from tests.support.agent_http import pubkey, secret, uvicorn_server
from workflow_delivery.api import nip98

# The live server's wait view listens with psycopg 3.
pytestmark = pytest.mark.psycopg3

EXAMPLES = 20


class NostrSigner(requests.auth.AuthBase):
    """Signs each request exactly as it leaves: its final URL, method and body."""

    def __init__(self, secret_key: bytes) -> None:
        self.secret_key = secret_key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode()
        request.headers["Authorization"] = nip98.sign_request(
            self.secret_key, url=request.url, method=request.method, body=body
        )
        return request


@pytest.fixture(scope="module")
def fuzz_server(django_db_setup, django_db_blocker):
    with uvicorn_server() as url:
        yield url


@pytest.fixture
def signed_session(transactional_db, fuzz_server):
    """An agent of community ``localhost`` with pending deliveries (so ``wait`` answers
    at once), and a session that signs as it."""
    key = secret()
    owner = factories.community("localhost")
    for _ in range(EXAMPLES * 3):
        factories.committed(factories.Step(owner=owner, targets=[pubkey(key)]))
    session = requests.Session()
    session.auth = NostrSigner(key)
    port = fuzz_server.rsplit(":", 1)[1]
    with session:
        yield session, f"http://localhost:{port}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_makes_the_api_fail(fuzz_server, signed_session, mode):
    session, base_url = signed_session
    schema = schemathesis.openapi.from_url(f"{fuzz_server}/agents/v1/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 11
    # wait first: the claims (a batch takes up to 100) may leave nothing pending, and
    # a wait with nothing pending waits out its timeout.
    operations.sort(key=lambda operation: not operation.path.endswith("/wait"))
    statuses: Counter[int] = Counter()

    for operation in operations:

        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        def fuzz(case) -> None:
            response = case.call_and_validate(
                base_url=base_url, session=session, checks=[not_a_server_error]
            )
            statuses[response.status_code] += 1

        fuzz()
    print(f"\n{mode.value} fuzz answers by status: {dict(sorted(statuses.items()))}")
    # Signed properly, most requests get past authentication into the views.
    assert sum(count for status, count in statuses.items() if status != 401) > statuses[401]
