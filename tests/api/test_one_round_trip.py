"""One request per delivery: a finish with ``next`` settles and claims the caller's next
delivery (its message included) in one statement, and a claim with ``wait`` answers as
soon as a delivery is claimable for the caller. Replay, scope and revocation hold for
both: a replayed event does nothing, only the caller's deliveries are claimed, and a
revoked key settles and claims nothing."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime

import pytest
from django.db import connections

from tests.api.helpers import Agent, answer, enrolled_secret
from tests.support import factories
from tests.support.agent_http import MOUNT
from workflow_delivery import services
from workflow_delivery.api import nip98
from workflow_delivery.models import AgentRequestReplay, WorkflowAgentDelivery
from workflow_delivery.protocol import Lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


def more(agent: Agent, count: int) -> list:
    ids = []
    for n in range(count):
        later = factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id=f"n{n}")
        ids.append(factories.committed(later)[0].id)
    return ids


def stored(delivery_id) -> tuple[str, int]:
    row = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    return row.status, row.lease_generation


def finish_path(lease: dict) -> str:
    return f"v1/deliveries/{lease['delivery_id']}/finish"


def claim(client, agent: Agent) -> dict:
    return answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)


def others(agent: Agent, ids: list, lease: dict) -> list:
    """The agent's deliveries but the one ``lease`` holds (in one test transaction
    the rows share created_at, so which one a claim takes first is by id)."""
    return [d for d in [agent.delivery.id, *ids] if str(d) != lease["delivery_id"]]


# -- finish with next ----------------------------------------------------------------


def test_a_finish_with_next_settles_and_answers_the_next_lease_with_its_message(client, agent):
    (following,) = more(agent, 1)
    first = claim(client, agent)["lease"]
    body = {"generation": 1, "outcome": "finished", "next": True, "lease_seconds": 45}
    settled = answer(agent.call(client, "POST", finish_path(first), body), 200)
    assert settled["result"] == "settled" and settled["outcome"] == "finished"
    lease, delivery = settled["next"]["lease"], settled["next"]["delivery"]
    assert stored(first["delivery_id"]) == ("finished", 1)
    assert lease["delivery_id"] == delivery["id"] != first["delivery_id"]
    assert delivery["status"] == "claimed" and lease["generation"] == 1
    assert delivery["message"]["content"] == "please review"
    assert stored(lease["delivery_id"])[0] == "claimed"
    assert {str(agent.delivery.id), str(following)} == {first["delivery_id"], lease["delivery_id"]}
    # Nothing left: the next settle answers next null.
    body = {"generation": 1, "outcome": "failed", "next": True}
    last = answer(agent.call(client, "POST", finish_path(lease), body), 200)
    assert last == {"result": "settled", "outcome": "failed", "next": None}


def test_a_retry_of_a_settle_with_next_reports_the_status_and_claims_nothing(client, agent):
    ids = more(agent, 1)
    first = claim(client, agent)["lease"]
    (following,) = others(agent, ids, first)
    failed = {"generation": 1, "outcome": "failed"}
    answer(agent.call(client, "POST", finish_path(first), failed), 200)
    body = {"generation": 1, "outcome": "finished", "next": True}
    retried = answer(agent.call(client, "POST", finish_path(first), body), 200)
    assert retried == {"result": "already_terminal", "status": "failed", "next": None}
    assert stored(following) == ("pending", 0)


def test_a_lost_lease_with_next_claims_nothing_and_keeps_no_replay_row(client, agent):
    ids = more(agent, 1)
    first = claim(client, agent)["lease"]
    (following,) = others(agent, ids, first)
    body = json.dumps({"generation": 7, "outcome": "finished", "next": True}).encode()
    path = finish_path(first)
    header = nip98.sign_request(
        agent.secret, url=f"http://{agent.host}{MOUNT}{path}", method="POST", body=body
    )
    before = AgentRequestReplay.objects.count()
    sent = agent.call(client, "POST", path, raw=body, authorization=header)
    answer(sent, 409, "lease_lost")
    assert AgentRequestReplay.objects.count() == before
    assert stored(first["delivery_id"]) == ("claimed", 1)
    assert stored(following) == ("pending", 0)
    # The same event again is judged afresh (not a replay): its row was never kept.
    again = agent.call(client, "POST", path, raw=body, authorization=header)
    answer(again, 409, "lease_lost")


def test_a_replayed_finish_with_next_does_nothing(client, agent):
    ids = more(agent, 2)
    first = claim(client, agent)["lease"]
    path = finish_path(first)
    body = json.dumps({"generation": 1, "outcome": "finished", "next": True}).encode()
    header = nip98.sign_request(
        agent.secret, url=f"http://{agent.host}{MOUNT}{path}", method="POST", body=body
    )
    settled = answer(agent.call(client, "POST", path, raw=body, authorization=header), 200)
    claimed = {settled["next"]["lease"]["delivery_id"]}
    replayed = agent.call(client, "POST", path, raw=body, authorization=header)
    answer(replayed, 401, "auth_replay")
    pending = [d for d in others(agent, ids, first) if str(d) not in claimed]
    assert [stored(d) for d in pending] == [("pending", 0)]


def test_a_finish_with_next_claims_only_the_callers_deliveries(client, agent):
    other = Agent(owner=agent.step.community)
    first = claim(client, agent)["lease"]
    body = {"generation": 1, "outcome": "finished", "next": True}
    settled = answer(agent.call(client, "POST", finish_path(first), body), 200)
    assert settled["next"] is None
    assert stored(other.delivery.id) == ("pending", 0)
    # Another agent's lease is not the caller's to settle, with next or without.
    theirs = claim(client, other)["lease"]
    answer(agent.call(client, "POST", finish_path(theirs), body), 409, "lease_lost")
    assert stored(other.delivery.id) == ("claimed", 1)
    # A key of another community is not an agent here.
    stranger = Agent()
    refused = stranger.call(client, "POST", finish_path(theirs), body, host=agent.host)
    answer(refused, 401, "auth_unknown_agent")


def test_a_revoked_key_settles_nothing_and_claims_nothing_with_next(client, agent):
    ids = more(agent, 1)
    first = claim(client, agent)["lease"]
    (following,) = others(agent, ids, first)
    services.revoke_agent(agent.step.community.id, agent.pubkey)
    body = {"generation": 1, "outcome": "finished", "next": True}
    answer(agent.call(client, "POST", finish_path(first), body), 401, "auth_revoked")
    assert stored(first["delivery_id"]) == ("pending", 2)  # released by the revocation
    assert stored(following) == ("pending", 0)


def test_lease_seconds_without_next_is_refused(client, agent):
    first = claim(client, agent)["lease"]
    body = {"generation": 1, "outcome": "finished", "lease_seconds": 30}
    answer(agent.call(client, "POST", finish_path(first), body), 400, "invalid_request")
    bad = {"generation": 1, "outcome": "finished", "next": "yes"}
    answer(agent.call(client, "POST", finish_path(first), bad), 400, "invalid_request")
    assert stored(first["delivery_id"]) == ("claimed", 1)


def test_a_finish_with_next_answers_a_json_message_as_its_value(client, agent):
    value = {"order": 17, "items": [{"sku": "A-1", "qty": 2}]}
    for key in ("first", "second"):
        services.send_message(
            agent.step.community.id, targets=[agent.pubkey], idempotency_key=key, content=value
        )
    claimed = claim(client, agent)
    messages = [claimed["delivery"]["message"]]
    lease = claimed["lease"]
    while True:
        body = {"generation": lease["generation"], "outcome": "finished", "next": True}
        following = answer(agent.call(client, "POST", finish_path(lease), body), 200)["next"]
        if following is None:
            break
        messages.append(following["delivery"]["message"])
        lease = following["lease"]
    # The fixture's text message and the two JSON ones, each as it was sent.
    assert sorted(message["content_kind"] for message in messages) == ["json", "json", "text"]
    sent = {"text": "please review", "json": value}
    assert all(message["content"] == sent[message["content_kind"]] for message in messages)


# -- claims that wait ------------------------------------------------------------------


def test_a_waiting_claim_answers_at_once_when_a_delivery_is_claimable(client, agent):
    started = time.monotonic()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"wait": 30}), 200)
    assert claimed["lease"]["delivery_id"] == str(agent.delivery.id)
    assert claimed["delivery"]["message"]["content"] == "please review"
    assert time.monotonic() - started < 10


def test_a_waiting_claim_with_nothing_to_claim_ends_empty(client, agent):
    claim(client, agent)
    assert answer(agent.call(client, "POST", "v1/claim", {"wait": 1}), 204) is None


@pytest.mark.parametrize("wait", [61, -1, "soon", 1.5], ids=str)
def test_a_bad_wait_is_a_400_and_claims_nothing(client, agent, wait):
    response = agent.call(client, "POST", "v1/claim", {"wait": wait})
    assert answer(response, 400, "invalid_request")["field"] == "wait"
    assert stored(agent.delivery.id) == ("pending", 0)


def test_only_a_claim_of_any_delivery_may_wait(client, agent):
    body = {"wait": 5, "delivery_id": str(agent.delivery.id)}
    refused = answer(agent.call(client, "POST", "v1/claim", body), 400, "invalid_request")
    assert refused["field"] == "wait"
    assert stored(agent.delivery.id) == ("pending", 0)


def test_a_waiting_claim_beyond_the_waiter_limit_is_told_to_poll(client, agent, settings):
    claim(client, agent)
    settings.WORKFLOW_DELIVERY_API_MAX_WAITERS = 0
    answer(agent.call(client, "POST", "v1/claim", {"wait": 5}), 503, "too_many_waiters")


def test_a_replayed_waiting_claim_is_refused(client, agent):
    body = json.dumps({"wait": 1}).encode()
    header = nip98.sign_request(
        agent.secret, url=f"http://{agent.host}{MOUNT}v1/claim", method="POST", body=body
    )
    answer(agent.call(client, "POST", "v1/claim", raw=body, authorization=header), 200)
    again = agent.call(client, "POST", "v1/claim", raw=body, authorization=header)
    answer(again, 401, "auth_replay")


def test_a_waiting_claim_of_a_revoked_or_unknown_key_is_refused(client, agent):
    stranger = enrolled_secret(factories.community())
    refused = agent.call(client, "POST", "v1/claim", {"wait": 1}, secret_key=stranger)
    answer(refused, 401, "auth_unknown_agent")
    services.revoke_agent(agent.step.community.id, agent.pubkey)
    answer(agent.call(client, "POST", "v1/claim", {"wait": 1}), 401, "auth_revoked")
    assert stored(agent.delivery.id) == ("pending", 0)


def _later(agent: Agent, seconds: float, action) -> threading.Thread:
    def run() -> None:
        try:
            time.sleep(seconds)
            action()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("notify", [True, False], ids=["woken", "polling"])
def test_a_waiting_claim_takes_a_delivery_committed_while_it_waits(client, agent, settings, notify):
    settings.WORKFLOW_DELIVERY_NOTIFY = notify
    settings.WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS = 0.2
    claim(client, agent)
    later = factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id="later")
    committer = _later(agent, 0.5, lambda: factories.committed(later))
    started = time.monotonic()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"wait": 10}), 200)
    elapsed = time.monotonic() - started
    committer.join(10)
    assert claimed["delivery"]["step_id"] == "later" and claimed["lease"]["generation"] == 1
    assert claimed["delivery"]["message"] is not None
    assert 0.4 < elapsed < 5


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("max_age", [60, 0], ids=["persistent", "per-request"])
def test_a_wsgi_thread_keeps_its_persistent_connection_while_its_claim_waits(
    client, agent, settings, monkeypatch, max_age
):
    """On a WSGI server's thread (the test client's) whose connection persists past the
    request, the waiting claim keeps it while it waits and claims on it when woken;
    with connections closed after each request it is released while the claim waits."""
    settings.WORKFLOW_DELIVERY_NOTIFY = True
    claim(client, agent)
    thread_connection = connections["default"]
    thread_connection.close()
    monkeypatch.setitem(thread_connection.settings_dict, "CONN_MAX_AGE", max_age)
    with thread_connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (before,) = cursor.fetchone()
    during: list = []

    def look_and_commit() -> None:
        raw = thread_connection.connection
        during.append(None if raw is None or raw.closed else raw.info.backend_pid)
        factories.committed(
            factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id="later")
        )

    committer = _later(agent, 0.5, look_and_commit)
    claimed = answer(agent.call(client, "POST", "v1/claim", {"wait": 10}), 200)
    committer.join(10)
    assert claimed["delivery"]["step_id"] == "later"
    if max_age:
        assert during == [before]
        with thread_connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            assert cursor.fetchone() == (before,)
    else:
        assert during == [None]


@pytest.mark.django_db(transaction=True)
def test_a_key_revoked_while_its_claim_waits_claims_nothing(client, agent, settings):
    settings.WORKFLOW_DELIVERY_NOTIFY = False
    settings.WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS = 0.2
    lease = claim(client, agent)
    # The delivery comes back after a short backoff: claimable while the claim waits.
    services.retry_delivery(
        Lease(
            community_id=agent.step.community.id,
            delivery_id=lease["lease"]["delivery_id"],
            target_pubkey=agent.pubkey,
            generation=1,
            lease_until=datetime.fromisoformat(lease["lease"]["lease_until"]),
        ),
        error="busy",
        delay_seconds=1.0,
    )
    revoker = _later(
        agent, 0.3, lambda: services.revoke_agent(agent.step.community.id, agent.pubkey)
    )
    assert answer(agent.call(client, "POST", "v1/claim", {"wait": 2}), 204) is None
    revoker.join(10)
    assert stored(agent.delivery.id) == ("pending", 2)


def test_the_new_answers_are_what_the_openapi_document_declares(client, agent):
    from tests.api.test_operations import _closed, _conforms

    openapi = _closed(answer(client.get("/agents/v1/openapi.json"), 200))
    more(agent, 1)
    claimed = answer(agent.call(client, "POST", "v1/claim", {"wait": 5}), 200)
    _conforms(openapi, "v1/claim", "post", claimed)
    body = {"generation": 1, "outcome": "finished", "next": True}
    one = "v1/deliveries/{delivery_id}/finish"
    settled = answer(agent.call(client, "POST", finish_path(claimed["lease"]), body), 200)
    assert settled["next"] is not None
    _conforms(openapi, one, "post", settled)
    last = answer(agent.call(client, "POST", finish_path(settled["next"]["lease"]), body), 200)
    assert last["next"] is None
    _conforms(openapi, one, "post", last)
    again = answer(agent.call(client, "POST", finish_path(settled["next"]["lease"]), body), 200)
    _conforms(openapi, one, "post", again)
