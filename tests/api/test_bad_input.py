"""Malformed or out-of-range input from an authenticated agent: not JSON, a wrong
type, a value out of range, an unknown field, a bad expected binding or a body over the
size limit is a clear 4xx naming the problem, never a 500, and writes nothing."""

from __future__ import annotations

import json

import pytest

from tests.api.helpers import answer, rows
from workflow_delivery.models import AgentRequestReplay

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


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
