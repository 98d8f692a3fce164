"""Every way the agent API refuses a request's NIP-98 ``Authorization`` header, one
test each: missing, malformed, of the wrong kind, id or signature, signed for another
URL, method, host or body, too far from the server's clock, or replayed. Each refusal
is a 401 naming its code and changes no delivery. Behind a proxy the origin setting
names the URL that is signed, and the signed host tag binds a request to one community."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import pytest

from tests.api.helpers import answer, rows
from tests.support import factories
from tests.support.agent_http import secret
from workflow_delivery.api import nip98
from workflow_delivery.models import AgentRequestReplay, WorkflowAgentDelivery

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


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
