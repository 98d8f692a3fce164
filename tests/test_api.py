"""The agent HTTP API in-process (Django's test client): NIP-98 refusals, scoping to
the signing key and to the Host's community, hostile input, the fence, and the replay
guard's table. The whole lifecycle against a real server is in api/test_live.py."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
import uuid
from datetime import UTC, timedelta

import pytest
from django.db import connection, connections, transaction
from django.test import Client, override_settings
from django.utils import timezone

from tests import factories
from tests.agent_http import pubkey, secret, signed
from tests.sessions import listening_sessions
from workflow_delivery import fence, services
from workflow_delivery.api import nip98
from workflow_delivery.api.wake import hub
from workflow_delivery.models import AgentRequestReplay, IdleWakeTarget, WorkflowAgentDelivery
from workflow_delivery.store import statements

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True, scope="module")
def stop_wake_listener():
    """The wait view starts this process's LISTEN connection; close it before the
    test database is dropped."""
    yield
    hub.stop()


@pytest.fixture(autouse=True)
def any_host(settings):
    settings.ALLOWED_HOSTS = ["*"]


@pytest.fixture
def client() -> Client:
    return Client()


def enrolled_secret(owner) -> bytes:
    """A new agent key enrolled in ``owner``'s roster, with no delivery."""
    key = secret()
    factories.enroll(owner, [pubkey(key)])
    return key


class Agent:
    """An agent key with one pending delivery in a fresh community."""

    def __init__(self, owner=None) -> None:
        self.secret = secret()
        self.pubkey = pubkey(self.secret)
        self.step = factories.Step(owner=owner, targets=[self.pubkey])
        self.delivery = factories.committed(self.step)[0]
        self.host = self.step.community.host

    def call(self, client: Client, method: str, path: str, document=None, **options):
        options.setdefault("host", self.host)
        options.setdefault("secret_key", self.secret)
        return signed(client, method, path, document, **options)


@pytest.fixture
def agent() -> Agent:
    return Agent()


def rows() -> list[dict]:
    return list(WorkflowAgentDelivery.objects.order_by("id").values())


def answer(response, status: int, code: str | None = None) -> dict | None:
    assert response.status_code == status, response.content
    if code is not None:
        document = response.json()
        assert document["error"] == code, document
        assert document["detail"]
        return document
    return response.json() if response.content else None


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
        "/agents/v1/deliveries/{delivery_id}",
        "/agents/v1/wait",
    }
    assert "NostrAuth" in document["components"]["securitySchemes"]


# -- every NIP-98 refusal, one test each -----------------------------------------------


def refused(response, code: str, before: list[dict]) -> None:
    answer(response, 401, code)
    assert rows() == before


def test_missing_authorization_is_refused(client, agent):
    before = rows()
    response = client.post("/agents/v1/claim", HTTP_HOST=agent.host)
    refused(response, "auth_missing", before)


def test_other_authorization_scheme_is_refused(client, agent):
    before = rows()
    refused(
        agent.call(client, "POST", "v1/claim", authorization="Bearer abc"), "auth_missing", before
    )


def test_undecodable_event_is_refused(client, agent):
    before = rows()
    refused(
        agent.call(client, "POST", "v1/claim", authorization="Nostr !!!"), "auth_malformed", before
    )
    not_an_event = "Nostr " + base64.b64encode(b'["a list"]').decode()
    refused(
        agent.call(client, "POST", "v1/claim", authorization=not_an_event), "auth_malformed", before
    )


def test_wrong_kind_is_refused(client, agent):
    before = rows()
    refused(agent.call(client, "POST", "v1/claim", kind=1), "auth_wrong_kind", before)


def _tampered(header: str, **changes) -> str:
    document = json.loads(base64.b64decode(header.split(" ", 1)[1]))
    document.update(changes)
    return "Nostr " + base64.b64encode(json.dumps(document).encode()).decode()


def test_wrong_event_id_is_refused(client, agent):
    before = rows()
    url = f"http://{agent.host}/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=url, method="POST")
    forged = _tampered(header, id=hashlib.sha256(b"another event").hexdigest())
    refused(agent.call(client, "POST", "v1/claim", authorization=forged), "auth_bad_id", before)


def test_wrong_signature_is_refused(client, agent):
    """A valid event of the agent, re-signed by someone else's key: the id still
    matches (same pubkey field) but the signature is not the agent's."""
    before = rows()
    url = f"http://{agent.host}/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=url, method="POST")
    intruder = nip98.sign_request(secret(), url=url, method="POST")
    other_sig = json.loads(base64.b64decode(intruder.split(" ", 1)[1]))["sig"]
    forged = _tampered(header, sig=other_sig)
    refused(
        agent.call(client, "POST", "v1/claim", authorization=forged), "auth_bad_signature", before
    )


def test_signature_of_a_key_that_is_not_a_curve_point_is_refused(client, agent):
    before = rows()
    url = f"http://{agent.host}/agents/v1/claim"
    document = json.loads(
        base64.b64decode(nip98.sign_request(agent.secret, url=url, method="POST").split(" ", 1)[1])
    )
    bogus = bytes(32)  # x = 0 is not on secp256k1
    digest = nip98.event_id(bogus, document["created_at"], document["kind"], document["tags"], "")
    forged = _tampered(
        "Nostr " + base64.b64encode(json.dumps(document).encode()).decode(),
        pubkey=bogus.hex(),
        id=digest.hex(),
    )
    refused(
        agent.call(client, "POST", "v1/claim", authorization=forged), "auth_bad_signature", before
    )


@pytest.mark.parametrize(
    "signed_url",
    [
        "https://{host}/agents/v1/claim",
        "http://elsewhere.example/agents/v1/claim",
        "http://{host}/agents/v1/claim?extra=1",
        "http://{host}/agents/v1/claim/",
    ],
)
def test_url_other_than_the_one_served_is_refused(client, agent, signed_url):
    before = rows()
    response = agent.call(client, "POST", "v1/claim", sign_url=signed_url.format(host=agent.host))
    refused(response, "auth_url_mismatch", before)


def test_query_string_is_part_of_the_signed_url(client, agent):
    response = agent.call(
        client,
        "GET",
        "v1/wait",
        query="timeout=0",
        sign_url=f"http://{agent.host}/agents/v1/wait?timeout=60",
    )
    refused(response, "auth_url_mismatch", rows())


def test_origin_setting_names_the_scheme_and_host_behind_a_proxy(client, agent, settings):
    settings.WORKFLOW_DELIVERY_API_ORIGIN = "https://agents.example"
    path = f"v1/deliveries/{agent.delivery.id}"
    direct = agent.call(client, "GET", path, sign_host=agent.host)
    answer(direct, 401, "auth_url_mismatch")
    shared = f"https://agents.example/agents/{path}"
    proxied = agent.call(client, "GET", path, sign_url=shared, sign_host=agent.host.upper())
    assert answer(proxied, 200)["id"] == str(agent.delivery.id)


def test_behind_a_shared_origin_the_event_must_name_its_community(client, agent, settings):
    settings.WORKFLOW_DELIVERY_API_ORIGIN = "https://agents.example"
    before = rows()
    shared = "https://agents.example/agents/v1/claim"
    refused(agent.call(client, "POST", "v1/claim", sign_url=shared), "auth_host_missing", before)
    assert not AgentRequestReplay.objects.exists()


def test_a_signed_request_replayed_at_another_community_is_refused(client, agent, settings):
    """Behind a shared origin the signed URL is the same for every community: the
    signed host tag binds the request to one, and its replay is refused at any."""
    settings.WORKFLOW_DELIVERY_API_ORIGIN = "https://agents.example"
    beta = factories.Step(targets=[agent.pubkey])
    factories.committed(beta)
    shared = "https://agents.example/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=shared, method="POST", host=agent.host)
    served = answer(agent.call(client, "POST", "v1/claim", authorization=header), 200)
    assert served["delivery"]["community_id"] == str(agent.step.community.id)
    before = rows()
    replayed = agent.call(
        client, "POST", "v1/claim", authorization=header, host=beta.community.host
    )
    refused(replayed, "auth_host_mismatch", before)
    refused(agent.call(client, "POST", "v1/claim", authorization=header), "auth_replay", before)
    assert WorkflowAgentDelivery.objects.get(community=beta.community).status == "pending"


def test_a_host_tag_must_name_the_host_served(client, agent):
    before = rows()
    response = agent.call(client, "POST", "v1/claim", sign_host="elsewhere.example")
    refused(response, "auth_host_mismatch", before)
    tagged = agent.call(client, "POST", "v1/claim", sign_host=agent.host)
    assert answer(tagged, 200)["delivery"]["id"] == str(agent.delivery.id)


def test_deeply_nested_json_in_the_header_is_malformed_not_a_crash(client, agent):
    before = rows()
    nested = "Nostr " + base64.b64encode(b"[" * 6000).decode()
    assert len(nested) < nip98.MAX_HEADER_CHARS
    response = agent.call(client, "POST", "v1/claim", authorization=nested)
    refused(response, "auth_malformed", before)
    deep_object = "Nostr " + base64.b64encode(b'{"a":' * 1500 + b"1" + b"}" * 1500).decode()
    refused(
        agent.call(client, "POST", "v1/claim", authorization=deep_object), "auth_malformed", before
    )


def test_wrong_method_is_refused(client, agent):
    before = rows()
    refused(
        agent.call(client, "POST", "v1/claim", sign_method="GET"), "auth_method_mismatch", before
    )


def test_body_without_a_payload_tag_is_refused(client, agent):
    before = rows()
    url = f"http://{agent.host}/agents/v1/claim"
    tags = [["u", url], ["method", "POST"]]
    response = agent.call(client, "POST", "v1/claim", {"lease_seconds": 5}, tags=tags)
    refused(response, "auth_payload_missing", before)


def test_body_changed_after_signing_is_refused(client, agent):
    before = rows()
    response = agent.call(
        client, "POST", "v1/claim", {"lease_seconds": 5}, sign_body=b'{"lease_seconds": 50}'
    )
    refused(response, "auth_payload_mismatch", before)


@pytest.mark.parametrize("offset", [-61, 61, -3600])
def test_created_at_too_far_from_the_server_clock_is_refused(client, agent, offset):
    before = rows()
    response = agent.call(client, "POST", "v1/claim", created_at=int(time.time()) + offset)
    refused(response, "auth_stale", before)
    assert not AgentRequestReplay.objects.exists()


def test_replayed_request_is_refused(client, agent):
    url = f"http://{agent.host}/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=url, method="POST")
    assert agent.call(client, "POST", "v1/claim", authorization=header).status_code == 200
    before = rows()
    refused(agent.call(client, "POST", "v1/claim", authorization=header), "auth_replay", before)


# -- scope: the signing key and the Host's community -------------------------------------


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


# -- hostile input: a clear 4xx, never a 500, nothing written ----------------------------


@pytest.mark.parametrize(
    ("path", "raw", "status", "code"),
    [
        ("v1/claim", b"{not json", 400, "invalid_json"),
        ("v1/claim", b'{"lease_seconds": 5', 400, "invalid_json"),
        ("v1/claim", b"\xff\xfe", 400, "invalid_json"),
        ("v1/claim", b"[]", 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": 0}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": -5}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": 1e400}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": 100000000000000000000000000000}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": 605201}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": "30"}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": true}', 400, "invalid_request"),
        ("v1/claim", b'{"lease_seconds": 30.5}', 400, "invalid_request"),
        ("v1/claim", b'{"delivery_id": "not-a-uuid"}', 400, "invalid_request"),
        (
            "v1/claim",
            b'{"delivery_id": "6F9619FF-8B86-D011-B42D-00C04FC964FF"}',
            400,
            "invalid_request",
        ),
        ("v1/claim", b'{"unknown": 1}', 400, "invalid_request"),
        ("v1/deliveries/not-a-uuid/renew", b'{"generation": 1}', 400, "invalid_request"),
        ("v1/deliveries/{id}/renew", b'{"generation": -1}', 400, "invalid_request"),
        (
            "v1/deliveries/{id}/renew",
            b'{"generation": 9223372036854775808}',
            400,
            "invalid_request",
        ),
        ("v1/deliveries/{id}/renew", b"{}", 400, "invalid_request"),
        (
            "v1/deliveries/{id}/finish",
            b'{"generation": 1, "outcome": "done"}',
            400,
            "invalid_request",
        ),
    ],
)
def test_bad_input_is_a_clear_4xx_and_writes_nothing(client, agent, path, raw, status, code):
    answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    before = rows()
    response = agent.call(client, "POST", path.format(id=agent.delivery.id), raw=raw)
    document = answer(response, status, code)
    assert rows() == before
    if code == "invalid_request":
        assert document["detail"]


def test_lease_seconds_above_the_configured_maximum_names_the_field(client, agent, settings):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 10
    before = rows()
    document = answer(
        agent.call(client, "POST", "v1/claim", {"lease_seconds": 11}), 400, "invalid_request"
    )
    assert document["field"] == "lease_seconds"
    assert rows() == before


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("target_pubkey", "AB" * 32, "target_pubkey"),
        ("message_event_id", "zz" * 32, "message_event_id"),
        ("definition_event_id", "ab" * 31, "definition_event_id"),
        ("workflow_id", "not-a-uuid", "workflow_id"),
        ("step_id", "", "step_id"),
        ("step_id", " ", "step_id"),
        ("cause", {"kind": "schedule", "scheduled_for": "2026-01-01T00:00:00"}, "scheduled_for"),
        ("cause", {"kind": "schedule", "scheduled_for": "2026-01-01T00:00:00.5Z"}, "scheduled_for"),
        ("cause", {"kind": "sorcery"}, "cause"),
        ("community_id", "00000000-0000-0000-0000-000000000000", "community_id"),
    ],
)
def test_bad_expected_binding_field_is_a_400_naming_it(client, agent, field, value, named):
    from workflow_delivery.wire import binding_document

    expected = binding_document(agent.step.binding(agent.pubkey)) | {field: value}
    before = rows()
    document = answer(
        agent.call(client, "POST", "v1/claim", {"expected": expected}), 400, "invalid_request"
    )
    assert named in document["detail"]
    assert rows() == before


def test_huge_body_is_refused_before_it_is_read(client, agent, settings):
    settings.WORKFLOW_DELIVERY_API_MAX_BODY_BYTES = 1024
    before = rows()
    huge = json.dumps({"lease_seconds": 5, "pad": "x" * 5000}).encode()
    answer(agent.call(client, "POST", "v1/claim", raw=huge), 413, "body_too_large")
    assert rows() == before
    assert not AgentRequestReplay.objects.exists()


def test_wait_timeout_out_of_range_is_a_400(client, agent):
    answer(agent.call(client, "GET", "v1/wait", query="timeout=61"), 400, "invalid_request")
    answer(agent.call(client, "GET", "v1/wait", query="timeout=soon"), 400, "invalid_request")


def test_wait_answers_at_once_for_a_delivery_already_pending(client, agent):
    started = time.monotonic()
    hint = answer(agent.call(client, "GET", "v1/wait", query="timeout=30"), 200)
    assert hint == {"delivery_id": str(agent.delivery.id), "target": agent.pubkey.hex()}
    assert time.monotonic() - started < 10


def test_wait_beyond_the_waiter_limit_is_told_to_poll(client, agent, settings):
    settings.WORKFLOW_DELIVERY_API_MAX_WAITERS = 0
    answer(agent.call(client, "GET", "v1/wait", query="timeout=5"), 503, "too_many_waiters")


def test_wait_without_a_pending_delivery_ends_empty(client, agent):
    answer(agent.call(client, "POST", "v1/claim"), 200)
    assert answer(agent.call(client, "GET", "v1/wait", query="timeout=1"), 204) is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("notify", [False, True], ids=["wake-ups off", "wake-ups on"])
def test_a_wait_polls_only_when_producers_send_no_wake_ups(client, agent, settings, notify):
    """Wake-ups off: a delivery committed while the agent waits is found by the
    wait's own poll, and the wait registers nothing. On (the default), the wait
    registers its caller as idle and relies on wake-ups: a delivery committed without
    one (sent by a process that has them off) is not seen before the timeout."""
    settings.WORKFLOW_DELIVERY_NOTIFY = notify
    settings.WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS = 0.2
    answer(agent.call(client, "POST", "v1/claim"), 200)
    later = factories.Step(owner=agent.step.community, targets=[agent.pubkey], step_id="later")

    def commit_quietly() -> None:
        try:
            time.sleep(0.5)
            with override_settings(WORKFLOW_DELIVERY_NOTIFY=False):
                factories.committed(later)
        finally:
            connections.close_all()

    hub.stop()
    deadline = time.monotonic() + 5
    while listening_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)  # the stopped listener's backend is on its way out
    committer = threading.Thread(target=commit_quietly)
    committer.start()
    started = time.monotonic()
    response = agent.call(client, "GET", "v1/wait", query="timeout=3")
    elapsed = time.monotonic() - started
    committer.join(10)
    # The process listens, and registers its waiter, only when there are wake-ups
    # to hear; the quiet producer left the registration in place.
    assert listening_sessions() == int(notify)
    idle = IdleWakeTarget.objects.filter(target_pubkey=agent.pubkey)
    assert list(idle.values_list("community_id", flat=True)) == (
        [agent.step.community.id] if notify else []
    )
    if notify:
        assert answer(response, 204) is None and elapsed >= 3
    else:
        (delivery,) = WorkflowAgentDelivery.objects.filter(step_id="later")
        hint = answer(response, 200)
        assert hint == {"delivery_id": str(delivery.id), "target": agent.pubkey.hex()}
        assert elapsed < 2


# -- the replay guard table --------------------------------------------------------------


def test_replay_guard_holds_an_event_once_across_communities():
    one, two = factories.community(), factories.community()
    event = factories.key32()
    now = int(time.time())
    assert services.record_request_event(one.id, event, now) == (True, True)
    assert services.record_request_event(one.id, event, now) == (True, False)
    assert services.record_request_event(two.id, event, now) == (True, False)
    agent = factories.key32()
    factories.enroll(two, [agent])
    admitted = services.admit_request_event(two.host.upper(), event, now, pubkey=agent)
    assert (admitted.community_id, admitted.fresh, admitted.recorded) == (two.id, True, False)
    assert admitted.standing == "enabled"
    assert services.record_request_event(one.id, factories.key32(), now - 120) == (False, False)
    assert AgentRequestReplay.objects.filter(event_id=event).count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_same_event_at_once_from_two_connections_is_recorded_once():
    owner = factories.community()
    event = factories.key32()
    now = int(time.time())
    barrier = threading.Barrier(4)
    results: list[tuple[bool, bool]] = []

    def arrive() -> None:
        try:
            barrier.wait(10)
            results.append(services.record_request_event(owner.id, event, now))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=arrive) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == [(True, False)] * 3 + [(True, True)]
    assert AgentRequestReplay.objects.filter(community=owner).count() == 1


def _replay(owner, age_seconds: int) -> AgentRequestReplay:
    return AgentRequestReplay.objects.create(
        community=owner,
        event_id=factories.key32(),
        event_created_at=timezone.now() - timedelta(seconds=age_seconds),
    )


def test_prune_removes_only_rows_past_the_window(settings):
    settings.WORKFLOW_DELIVERY_API_MAX_CLOCK_SKEW_SECONDS = 60
    owner = factories.community()
    old = [_replay(owner, 600) for _ in range(3)]
    kept = [_replay(owner, 0), _replay(owner, 90)]
    assert services.prune_replay_guard(batch_size=2) == 3
    remaining = set(AgentRequestReplay.objects.values_list("id", flat=True))
    assert remaining == {row.id for row in kept}
    assert not remaining & {row.id for row in old}


def test_prune_skips_a_community_being_deleted():
    healthy, leaving = factories.community(), factories.community()
    _replay(healthy, 600)
    frozen = _replay(leaving, 600)
    factories.move_to(leaving.id, "fenced")
    assert services.prune_replay_guard() == 1
    assert list(AgentRequestReplay.objects.values_list("id", flat=True)) == [frozen.id]


def test_purge_of_a_community_deletes_its_replay_rows():
    owner = factories.community()
    _replay(owner, 0)
    generation = factories.move_to(owner.id, "fenced")
    deleted = fence.purge_community(owner.id, generation)
    assert deleted[AgentRequestReplay._meta.db_table] == 1
    assert AgentRequestReplay._meta.db_table in [table for table, _ in statements.PURGE]
    assert not AgentRequestReplay.objects.filter(community=owner).exists()


def test_replay_rows_are_behind_the_write_fence(raw):
    owner = factories.community()
    factories.move_to(owner.id, "fenced")
    from workflow_delivery.exceptions import CommunityWriteFenced

    with pytest.raises(CommunityWriteFenced):
        services.record_request_event(owner.id, factories.key32(), int(time.time()))
    assert connection.in_atomic_block


# -- one transaction per request -------------------------------------------------------


def test_a_refused_operation_keeps_no_replay_row(client, agent):
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    path = f"v1/deliveries/{claimed['lease']['delivery_id']}"
    stale = {"generation": claimed["lease"]["generation"] + 1}
    answer(agent.call(client, "POST", f"{path}/renew", stale), 409, "lease_lost")
    answer(agent.call(client, "POST", f"{path}/finish", stale | {"outcome": "failed"}), 409)
    answer(agent.call(client, "GET", f"v1/deliveries/{uuid.uuid4()}"), 404, "not_found")
    assert AgentRequestReplay.objects.count() == 1


def test_the_same_signed_request_refused_once_is_judged_afresh(client, agent, settings):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 60
    body = json.dumps({"lease_seconds": 600}).encode()
    url = f"http://{agent.host}/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
    before = rows()
    first = agent.call(client, "POST", "v1/claim", raw=body, authorization=header)
    assert answer(first, 400, "invalid_request")["field"] == "lease_seconds"
    assert rows() == before and not AgentRequestReplay.objects.exists()
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 3600
    retried = answer(agent.call(client, "POST", "v1/claim", raw=body, authorization=header), 200)
    assert retried["delivery"]["id"] == str(agent.delivery.id)
    again = agent.call(client, "POST", "v1/claim", raw=body, authorization=header)
    answer(again, 401, "auth_replay")


@pytest.mark.django_db(transaction=True)
def test_a_lease_lost_in_autocommit_keeps_no_replay_row_and_its_retry_is_judged_afresh(
    settings,
):
    """Outside a test transaction each request is one statement in autocommit: the
    refusal raised inside it undoes its replay row, so the same signed request sent
    again is refused for its lease again, not as a replay."""
    settings.ALLOWED_HOSTS = ["*"]
    agent = Agent()
    client = Client()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 60}), 200)
    before = AgentRequestReplay.objects.count()
    stale = claimed["lease"]["generation"] + 1
    for path, document in (
        (f"v1/deliveries/{agent.delivery.id}/finish", {"generation": stale, "outcome": "failed"}),
        (f"v1/deliveries/{agent.delivery.id}/renew", {"generation": stale}),
    ):
        body = json.dumps(document).encode()
        url = f"http://{agent.host}/agents/{path}"
        header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
        for _ in range(2):
            sent = agent.call(client, "POST", path, raw=body, authorization=header)
            answer(sent, 409, "lease_lost")
        assert AgentRequestReplay.objects.count() == before
    assert WorkflowAgentDelivery.objects.get(id=agent.delivery.id).status == "claimed"
    # The honest finish settles once; its replay runs nothing.
    path = f"v1/deliveries/{agent.delivery.id}/finish"
    body = json.dumps({"generation": stale - 1, "outcome": "finished"}).encode()
    url = f"http://{agent.host}/agents/{path}"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
    settled = answer(agent.call(client, "POST", path, raw=body, authorization=header), 200)
    assert settled == {"result": "settled", "outcome": "finished"}
    answer(agent.call(client, "POST", path, raw=body, authorization=header), 401, "auth_replay")
    assert AgentRequestReplay.objects.count() == before + 1
    # A new signature of the same settle: what a retry sees, recorded.
    again = answer(
        agent.call(client, "POST", path, {"generation": stale - 1, "outcome": "failed"}), 200
    )
    assert again == {"result": "already_terminal", "status": "finished"}
    assert AgentRequestReplay.objects.count() == before + 2


def _waiting_on_locks(count: int) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0] >= count:
                return True
        time.sleep(0.02)
    return False


@pytest.mark.django_db(transaction=True)
def test_two_identical_requests_at_once_run_once_and_the_replay_row_waits_for_the_operation(
    settings,
):
    """The replay row is written in the operation's transaction: while the finish
    waits for its row, its replay row is not committed, and the identical request
    sent meanwhile waits on that row, then is refused; the delivery settles once."""
    settings.ALLOWED_HOSTS = ["*"]
    agent = Agent()
    client = Client()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 60}), 200)
    path = f"v1/deliveries/{agent.delivery.id}/finish"
    body = json.dumps({"generation": claimed["lease"]["generation"], "outcome": "finished"})
    url = f"http://{agent.host}/agents/{path}"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body.encode())
    event_id = bytes.fromhex(json.loads(base64.b64decode(header.split(" ", 1)[1]))["id"])
    answers: list = []

    def send() -> None:
        try:
            response = agent.call(Client(), "POST", path, raw=body.encode(), authorization=header)
            answers.append((response.status_code, response.json()))
        finally:
            connections.close_all()

    locked, release = threading.Event(), threading.Event()

    def lock_the_row() -> None:
        try:
            with transaction.atomic():
                WorkflowAgentDelivery.objects.select_for_update().get(id=agent.delivery.id)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    locker = threading.Thread(target=lock_the_row)
    senders = [threading.Thread(target=send) for _ in range(2)]
    locker.start()
    try:
        assert locked.wait(10)
        senders[0].start()
        assert _waiting_on_locks(1), answers
        senders[1].start()
        assert _waiting_on_locks(2), answers
        # Both wait: the first on the delivery's row, the second on the first's
        # replay row, which is not committed yet.
        assert not AgentRequestReplay.objects.filter(event_id=event_id).exists()
    finally:
        release.set()
        for thread in (locker, *senders):
            if thread.ident is not None:
                thread.join(30)
    codes = sorted(
        (status, document.get("result") or document.get("error")) for status, document in answers
    )
    assert codes == [(200, "settled"), (401, "auth_replay")]
    assert WorkflowAgentDelivery.objects.get(id=agent.delivery.id).status == "finished"
    assert AgentRequestReplay.objects.filter(event_id=event_id).count() == 1


# -- the message, to its target only ---------------------------------------------------


def _message(step: factories.Step) -> dict:
    event = step.message
    return {
        "id": bytes(event.id).hex(),
        "pubkey": bytes(event.pubkey).hex(),
        "created_at": event.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "kind": 9,
        "tags": event.tags,
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
