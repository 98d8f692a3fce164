"""AgentClient against a real server (pytest-django's live server): an answer that
is not the API's JSON, the message it returns, the batch calls."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from tests.support import factories
from tests.support.agent_http import pubkey, secret
from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import AgentApiError
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    LeaseLost,
    Outcome,
    Settled,
)

# The live server runs in another thread: the rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def _client(live_server, host: str, key: bytes) -> AgentClient:
    port = int(live_server.url.rsplit(":", 1)[1])
    return AgentClient(
        f"http://{host}:{port}/agents/", key, connect_to=("127.0.0.1", port), timeout=10
    )


def test_an_answer_that_is_not_json_is_an_agent_api_error(live_server, settings):
    settings.ALLOWED_HOSTS = ["only.example"]
    with (
        _client(live_server, "refused.example", secret()) as client,
        pytest.raises(AgentApiError) as caught,
    ):
        client.claim()
    assert caught.value.status == 400
    assert caught.value.code == "not_json"
    assert "Bad Request" in caught.value.detail and len(caught.value.detail) <= 200


def test_the_client_returns_the_message_and_settles_in_batches(live_server, settings):
    settings.ALLOWED_HOSTS = ["*"]
    key = secret()
    owner = factories.community()
    steps = [factories.Step(owner=owner, targets=[pubkey(key)], step_id=f"s-{n}") for n in range(3)]
    for step in steps:
        factories.committed(step)
    with _client(live_server, owner.host, key) as client:
        lease, record = single = client.claim(lease_seconds=30)
        assert single.message.id == bytes(steps[0].message.id)
        assert single.message.content == "please review" and single.message.kind == 9
        # What claim_delivery returns is a pair, and callers index it as one.
        assert (single[0], single[1], len(single)) == (lease, record, 2)
        assert client.message(record.id) == single.message
        batch = client.claim_many(5, lease_seconds=30)
        assert [item.record.binding.step_id for item in batch] == ["s-1", "s-2"]
        assert [item.message.id for item in batch] == [bytes(s.message.id) for s in steps[1:]]
        results = client.finish_many(
            [(lease, "finished"), (batch[0].lease, Outcome.FAILED), (lease, "failed")]
        )
        assert results == [
            Settled(Outcome.FINISHED),
            Settled(Outcome.FAILED),
            AlreadyTerminal(status=results[2].status),
        ]
        assert results[2].status.value == "finished"
    stranger = secret()
    factories.enroll(owner, [pubkey(stranger)])
    with _client(live_server, owner.host, stranger) as intruder:
        assert intruder.message(record.id) is None
        assert intruder.finish_many([(batch[1].lease, "finished")]) == [LeaseLost()]


def test_the_client_waits_for_a_claim_and_settles_each_delivery_with_the_next(
    live_server, settings
):
    settings.ALLOWED_HOSTS = ["*"]
    settings.WORKFLOW_DELIVERY_NOTIFY = False
    settings.WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS = 0.2
    key = secret()
    owner = factories.community()
    steps = [factories.Step(owner=owner, targets=[pubkey(key)], step_id=f"s-{n}") for n in range(3)]

    def commit_later() -> None:
        try:
            time.sleep(0.5)
            for step in steps:
                factories.committed(step)
        finally:
            connections.close_all()

    committer = threading.Thread(target=commit_later)
    committer.start()
    with _client(live_server, owner.host, key) as client:
        claimed = client.claim(wait=10, lease_seconds=30)
        committer.join(10)
        seen = []
        lease = None
        while claimed is not None:
            lease = claimed.lease
            seen.append(claimed.record.binding.step_id)
            assert claimed.message.content == "please review"
            answer = client.finish_and_claim_next(claimed.lease, "finished", lease_seconds=30)
            assert answer.result == Settled(Outcome.FINISHED)
            claimed = answer.next
        assert seen == ["s-0", "s-1", "s-2"]
        assert client.claim(wait=1) is None
        # A retry of the last settle reports it and claims nothing; another's is lost.
        retried = client.finish_and_claim_next(lease, "failed")
        assert retried.result == AlreadyTerminal(status=DeliveryStatus.FINISHED)
        assert retried.next is None
    stranger = secret()
    factories.enroll(owner, [pubkey(stranger)])
    with _client(live_server, owner.host, stranger) as intruder:
        assert intruder.finish_and_claim_next(lease, "finished").result == LeaseLost()
