"""The ACP runtime without the database: ``python -m workflow_delivery.acp`` as a
process whose ``django`` imports are refused (``tests/support/acp_api_runner.py``), driving
the scripted ACP agent (``tests/support/acp_agent.py``) with leases from the real agent API
(uvicorn serving the demo project over the test database). No protocol is mocked.
The endpoints the runtime needs beyond claim, renew and finish (reply, replies,
retry, release, finish with a reason) are also driven directly, by ``AgentClient``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support import SUPPORT, factories
from tests.support.agent_http import pubkey, secret, uvicorn_server
from tests.support.consumers import eventually, status
from workflow_delivery.client import AgentClient
from workflow_delivery.exceptions import AgentApiError
from workflow_delivery.models import AgentTurn, Event, WorkflowAgentDelivery
from workflow_delivery.protocol import (
    AlreadyTerminal,
    DeliveryStatus,
    LeaseLost,
    Outcome,
    Retried,
    Settled,
)
from workflow_delivery.services import release_deliveries, revoke_agent, send_message

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]

ROOT = Path(__file__).resolve().parents[2]
# ACP_CLIENT_PYTHON: the interpreter of a venv with only the [acp-client] extra, to
# run the runner there (its imports come from this checkout, its dependencies from
# that venv); by default this one, with Django refused by the runner.
RUNNER = [
    os.environ.get("ACP_CLIENT_PYTHON") or sys.executable,
    str(SUPPORT / "acp_api_runner.py"),
]
AGENT = [sys.executable, str(SUPPORT / "acp_agent.py")]
SECRET_VARIABLE = "WD_TEST_AGENT_SECRET"
# Generous on a loaded machine: the agent's interpreter starts and imports two SDKs.
HANDSHAKE = "60"
RUN_TIMEOUT = 120


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    with uvicorn_server() as url:
        yield url


def base_url(server: str) -> str:
    return f"http://localhost:{server.rsplit(':', 1)[1]}/agents/"


@pytest.fixture
def roster():
    """A community served at ``localhost``, an agent (its secret) and an enrolled peer."""
    owner = factories.community("localhost")
    key, peer = secret(), factories.key32()
    factories.enroll(owner, [pubkey(key), peer])
    return owner, key, peer


def send(owner, key: bytes, content: str, idempotency_key: str = "k1"):
    sent = send_message(
        owner.id, targets=[pubkey(key)], content=content, idempotency_key=idempotency_key
    )
    return sent.deliveries[0].id


def command(server: str, *extra: str, agent_command=AGENT, api: str | None = None) -> list[str]:
    return [
        *RUNNER,
        "--api",
        api or base_url(server),
        "--secret-env",
        SECRET_VARIABLE,
        "--lease-seconds",
        "5",
        "--wait",
        "1",
        "--handshake-timeout",
        HANDSHAKE,
        *extra,
        "--",
        *agent_command,
    ]


def environment(key: bytes | None, **extra: str) -> dict[str, str]:
    found = {name: value for name, value in os.environ.items() if name != SECRET_VARIABLE}
    if key is not None:
        found[SECRET_VARIABLE] = key.hex()
    return {**found, **extra}


def run(server: str, key: bytes | None, *extra: str, **options) -> subprocess.CompletedProcess:
    env = environment(key, **options.pop("env", {}))
    return subprocess.run(
        command(server, *extra, **options),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        # A child of a background test run may inherit SIGINT ignored: set it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def start(server: str, key: bytes, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        command(server, *extra),
        cwd=ROOT,
        env=environment(key),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def stopped(process: subprocess.Popen) -> tuple[str, str]:
    try:
        return process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def row(delivery_id) -> WorkflowAgentDelivery:
    return WorkflowAgentDelivery.objects.get(id=delivery_id)


def replies_to(peer: bytes) -> list[Event]:
    return list(Event.objects.filter(tags__contains=[["p", peer.hex(), "", "message-v1"]]))


# -- the runtime, a process -------------------------------------------------------------


def test_a_delivery_becomes_a_turn_and_finishes(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "answer hello")
    result = run(server, key, "--max-deliveries", "1")
    assert result.returncode == 0, result.stderr
    assert "done: claimed=1 finished=1" in result.stdout
    found = row(delivery)
    assert found.status == "finished" and found.attempts == 1


def test_a_json_message_is_prompted_as_its_json_text(server, roster):
    owner, key, _ = roster
    sent = send_message(
        owner.id, targets=[pubkey(key)], content={"ask": "status"}, idempotency_key="k-json"
    )
    result = run(server, key, "--max-deliveries", "1")
    assert result.returncode == 0, result.stderr
    assert row(sent.deliveries[0].id).status == "finished"


def test_what_the_agent_said_is_stored_with_the_settle(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "transcript 2")
    crashed = send(owner, key, "crash", "k-crash")
    result = run(server, key, "--max-deliveries", "2")
    assert result.returncode == 0, result.stderr
    assert row(delivery).status == "finished"
    [turn] = AgentTurn.objects.filter(delivery_id=delivery)
    assert (turn.outcome, turn.stop_reason, turn.attempts) == ("finished", "end_turn", 1)
    assert turn.text == "<b>part 0</b> & <b>part 1</b> & given no; done"
    assert turn.said_bytes == len(turn.text)
    assert turn.tool_calls == [
        {"id": "t1", "title": "read <notes>", "kind": "read", "status": "completed"},
        {"id": "t2", "title": "edit config", "kind": "edit", "status": "failed"},
    ]
    [asked] = turn.permissions
    assert (asked["title"], asked["answer"], asked["option"]) == (
        "delete <everything>",
        "denied",
        "no",
    )
    # A retried attempt keeps what was said before the agent died.
    [died] = AgentTurn.objects.filter(delivery_id=crashed)
    assert died.outcome == "retried" and died.stop_reason is None and died.attempts == 1


def test_a_reply_through_the_mcp_tool_is_stored_once_and_delivered(server, roster):
    owner, key, peer = roster
    delivery = send(owner, key, f"reply-twice {peer.hex()} thanks, done")
    result = run(server, key, "--max-deliveries", "1")
    assert result.returncode == 0, result.stderr
    assert row(delivery).status == "finished"
    [reply] = replies_to(peer)
    asked = row(delivery)
    assert reply.content == "thanks, done" and bytes(reply.pubkey) == pubkey(key)
    assert ["e", bytes(asked.message_event_id).hex(), "", "reply"] in reply.tags
    [sent] = WorkflowAgentDelivery.objects.filter(target_pubkey=peer)
    assert sent.run_id == asked.run_id


def test_a_refusal_fails_the_delivery_for_good(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "refuse")
    result = run(server, key, "--max-deliveries", "1")
    assert result.returncode == 0, result.stderr
    found = row(delivery)
    assert found.status == "failed" and found.attempts == 1
    assert "refusal" in found.last_error_message


def test_an_agent_that_dies_mid_turn_is_retried_with_the_error_kept(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "crash")
    result = run(server, key, "--max-deliveries", "1")
    assert result.returncode == 0, result.stderr
    assert "retried=1" in result.stdout
    found = row(delivery)
    assert found.status == "pending" and found.attempts == 1
    assert "AgentError" in found.last_error_message
    assert "exit status" in found.last_error_message


def test_a_turn_timeout_cancels_and_retries(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "hang")
    result = run(server, key, "--max-deliveries", "1", "--turn-timeout", "1")
    assert result.returncode == 0, result.stderr
    found = row(delivery)
    assert found.status == "pending" and found.attempts == 1
    assert "TurnTimeout" in found.last_error_message


def test_a_lost_lease_cancels_the_turn_and_its_late_reply_stores_nothing(server, roster):
    owner, key, peer = roster
    delivery = send(owner, key, f"hang-reply {peer.hex()} too late")
    process = start(server, key, "--max-deliveries", "1", "--verbose")
    try:
        assert eventually(lambda: status(delivery) is DeliveryStatus.CLAIMED, 60)
        time.sleep(0.5)
        assert release_deliveries(owner.id, [delivery]) == [delivery]
        released_at = datetime.now()
        out, err = stopped(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "lost=1" in out, out
    # Renewed every half second: the loss is seen, and the turn cancelled, within a
    # second (twice that here, for a loaded machine).
    assert (cancelled_at(err, delivery) - released_at).total_seconds() < 2.0
    assert not replies_to(peer)
    assert not WorkflowAgentDelivery.objects.filter(target_pubkey=peer).exists()
    assert row(delivery).status == "pending"


def cancelled_at(err: str, delivery) -> datetime:
    """When the runner (``--verbose``) logged the cancel of the turn of ``delivery``
    for a lost lease."""
    [line] = [line for line in err.splitlines() if f"cancelling the turn of {delivery}" in line]
    assert line.endswith(": lost"), line
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def test_a_key_revoked_mid_turn_cancels_the_turn_and_settles_nothing(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "hang")
    process = start(server, key, "--max-deliveries", "1", "--verbose")
    try:
        assert eventually(lambda: status(delivery) is DeliveryStatus.CLAIMED, 60)
        time.sleep(0.5)
        revoke_agent(owner.id, pubkey(key))
        revoked_at = datetime.now()
        out, err = stopped(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "lost=1" in out and "auth_revoked" in err, (out, err)
    # At the first renew refused, not when the lease would have run out (5 s).
    assert (cancelled_at(err, delivery) - revoked_at).total_seconds() < 2.0
    found = row(delivery)
    assert found.status == "pending" and found.attempts == 1


def test_sigterm_cancels_the_turn_releases_its_lease_and_exits_zero(server, roster):
    owner, key, _ = roster
    delivery = send(owner, key, "hang")
    process = start(server, key)
    try:
        assert eventually(lambda: status(delivery) is DeliveryStatus.CLAIMED, 60)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        out, err = stopped(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "stopped by SIGTERM" in out and "released=1" in out, out
    found = row(delivery)
    assert found.status == "pending" and found.lease_generation == 2


@pytest.mark.parametrize(
    ("case", "expected", "code"),
    [
        ("no secret", f"the environment variable {SECRET_VARIABLE} is not set", 2),
        ("unreachable", "cannot reach the agent API at http://127.0.0.1:9/agents/", 1),
        ("no agent", "cannot start the agent '/nonexistent/acp-agent'", 1),
        ("not enrolled", "the agent API refused: 401 auth_unknown_agent", 1),
        ("mute agent", "did not answer initialize within 0.5 s", 1),
    ],
)
def test_bad_input_is_a_clear_error_and_claims_nothing(server, roster, case, expected, code):
    owner, key, _ = roster
    delivery = send(owner, key, "answer")
    options: dict = {}
    extra: tuple[str, ...] = ()
    given = key
    if case == "no secret":
        given = None
    elif case == "unreachable":
        options["api"] = "http://127.0.0.1:9/agents/"
    elif case == "no agent":
        options["agent_command"] = ["/nonexistent/acp-agent"]
    elif case == "mute agent":
        # The last --handshake-timeout given wins.
        extra += ("--handshake-timeout", "0.5")
        options["env"] = {"ACP_AGENT_MODE": "mute"}
    else:
        given = secret()
    result = run(server, given, "--max-deliveries", "1", *extra, **options)
    assert result.returncode == code, result.stderr
    assert expected in result.stderr
    found = row(delivery)
    assert found.status == "pending" and found.attempts == 0


# -- the endpoints, through the client ---------------------------------------------------


def test_a_reply_is_sent_once_per_key_and_only_under_the_live_lease(server, roster):
    owner, key, peer = roster
    delivery = send(owner, key, "anything")
    stranger = factories.key32()
    with AgentClient(base_url(server), key) as agent:
        lease, record = agent.claim(lease_seconds=30)
        first = agent.reply(lease, "first", [peer.hex()], idempotency_key="a")
        again = agent.reply(lease, "first", [peer.hex()], idempotency_key="a")
        assert first.created and not again.created
        assert again.message_id == first.message_id and first.run_id == record.binding.run_id
        assert len(first.deliveries) == 1
        with pytest.raises(AgentApiError) as refused:
            agent.reply(lease, "to a stranger", [stranger.hex()], idempotency_key="b")
        assert refused.value.status == 400 and refused.value.code == "target_not_enrolled"
        [listed] = agent.replies(delivery)
        assert listed == {"id": first.message_id.hex(), "content": "first", "pubkey": key_hex(key)}

        assert release_deliveries(owner.id, [delivery]) == [delivery]
        late = agent.reply(lease, "late", [peer.hex()], idempotency_key="c")
        assert late == LeaseLost()
    assert [event.content for event in replies_to(peer)] == ["first"]
    assert not replies_to(stranger)
    assert WorkflowAgentDelivery.objects.filter(target_pubkey=peer).count() == 1


def key_hex(key: bytes) -> str:
    return pubkey(key).hex()


def test_settles_beyond_finish_fail_with_a_reason_retry_and_release(server, roster):
    owner, key, _ = roster
    failing = send(owner, key, "one", "k-fail")
    retrying = send(owner, key, "two", "k-retry")
    releasing = send(owner, key, "three", "k-release")
    with AgentClient(base_url(server), key) as agent:
        lease, _ = agent.claim(delivery_id=failing)
        assert agent.fail(lease, "the agent refused it") == Settled(Outcome.FAILED)
        assert agent.fail(lease, "again") == AlreadyTerminal(DeliveryStatus.FAILED)

        lease, _ = agent.claim(delivery_id=retrying)
        retried = agent.retry(lease, "AgentError: it died", delay_seconds=120)
        assert isinstance(retried, Retried) and retried.attempts == 1
        assert agent.retry(lease, "again") == LeaseLost()

        lease, _ = agent.claim(delivery_id=releasing)
        assert agent.release(lease) is True
        assert agent.release(lease) is False

        # A reason goes with a failure only.
        answered = agent.request(
            "POST",
            f"v1/deliveries/{releasing}/finish",
            {"generation": 2, "outcome": "finished", "error": "no"},
        )
    assert answered[0] == 400 and answered[1]["field"] == "error"
    failed = row(failing)
    assert failed.status == "failed" and failed.last_error_message == "the agent refused it"
    pending = row(retrying)
    assert pending.status == "pending" and pending.last_error_message == "AgentError: it died"
    assert pending.available_at is not None
    released = row(releasing)
    assert released.status == "pending" and released.lease_generation == 2


def test_the_new_endpoints_are_in_the_openapi_document(server):
    with AgentClient(base_url(server), secret()) as agent:
        status_code, document = agent.request("GET", "v1/openapi.json")
    assert status_code == 200
    paths = set(document["paths"])
    for name in ("reply", "replies", "retry", "release"):
        assert f"/agents/v1/deliveries/{{delivery_id}}/{name}" in paths
    finish = document["paths"]["/agents/v1/deliveries/{delivery_id}/finish"]["post"]
    schema_name = finish["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert "error" in document["components"]["schemas"][schema_name.rsplit("/", 1)[1]]["properties"]
    json.dumps(document)


IMPORTS = """
import json, sys

class NoDjango:
    def find_spec(self, name, path=None, target=None):
        if name == "django" or name.startswith("django."):
            raise ImportError(name)

sys.meta_path.insert(0, NoDjango())
import workflow_delivery.acp as acp
from workflow_delivery.acp import ApiAgent, __main__
try:
    acp.AcpAgent
except ImportError:
    in_process = "needs django"
else:
    in_process = "imported"
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith("workflow_delivery")),
    "django": sorted(m for m in sys.modules if m == "django" or m.startswith("django.")),
    "in_process": in_process,
}))
"""


def test_the_api_runner_imports_without_django():
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["django"] == [] and seen["in_process"] == "needs django"
    assert set(seen["modules"]) == {
        "workflow_delivery",
        "workflow_delivery.acp",
        "workflow_delivery.acp.__main__",
        "workflow_delivery.acp.remote",
        "workflow_delivery.acp.runtime",
        "workflow_delivery.acp.turns",
        "workflow_delivery.client",
        "workflow_delivery.exceptions",
        "workflow_delivery.keys",
        "workflow_delivery.protocol",
        "workflow_delivery.wire",
    }


def test_read_message_over_the_api_gives_the_message_its_run_and_the_replies(server, roster):
    from workflow_delivery.acp.remote import _ApiEffects

    owner, key, peer = roster
    delivery = send(owner, key, "what now?")
    with AgentClient(base_url(server), key) as agent:
        claimed = agent.claim(lease_seconds=30)
        lease, record = claimed
        effects = _ApiEffects(agent, lease, record, claimed.message)
        said = effects.reply("on it", [peer.hex()])
        read = effects.read()
    assert said.startswith("reply ") and "sent to 1 agent(s)" in said
    asked = row(delivery)
    assert read["delivery_id"] == str(delivery) and read["run_id"] == str(asked.run_id)
    assert read["step_id"] == asked.step_id
    assert read["message"]["content"] == "what now?"
    assert read["message"]["id"] == bytes(asked.message_event_id).hex()
    assert [(item["content"], item["pubkey"]) for item in read["replies"]] == [
        ("on it", key_hex(key))
    ]


def test_a_settle_carries_the_turn_within_its_bounds(server, roster, settings):
    owner, key, _ = roster
    finished = send(owner, key, "one", "k-1")
    retried = send(owner, key, "two", "k-2")
    said = {
        "text": "all done",
        "said_bytes": 20,
        "stop_reason": "end_turn",
        "tool_calls": [{"id": "t1", "title": "read", "kind": "read", "status": "completed"}],
        "permissions": [],
    }
    with AgentClient(base_url(server), key) as agent:
        lease, _ = agent.claim(delivery_id=finished)
        path = f"v1/deliveries/{finished}/finish"
        refused = [
            ({"turn": said | {"said_bytes": 3}}, "turn.said_bytes"),
            ({"turn": said, "next": True}, "turn"),
            ({"turn": said | {"tool_calls": [{"id": "x" * 301}]}}, "turn.tool_calls.0.id"),
        ]
        for change, field in refused:
            document = {"generation": lease.generation, "outcome": "finished"} | change
            status_code, answer = agent.request("POST", path, document)
            assert (status_code, answer["field"]) == (400, field), answer
        assert agent.finish(lease, "finished", turn=said) == Settled(Outcome.FINISHED)
        assert agent.finish(lease, "finished", turn=said) == AlreadyTerminal(
            DeliveryStatus.FINISHED
        )
        lease, _ = agent.claim(delivery_id=retried)
        assert isinstance(agent.retry(lease, "it died", turn=said | {"stop_reason": None}), Retried)
    [kept] = AgentTurn.objects.filter(delivery_id=finished)
    assert (kept.outcome, kept.text, kept.said_bytes) == ("finished", "all done", 20)
    assert kept.tool_calls == said["tool_calls"]
    [again] = AgentTurn.objects.filter(delivery_id=retried)
    assert again.outcome == "retried" and again.attempts == 1


def test_a_turn_document_fits_its_budget():
    from workflow_delivery.acp.remote import turn_document
    from workflow_delivery.acp.runtime import Turn

    turn = Turn(run_id=None, delivery_id=None, blocks=[], max_bytes=16384)
    turn.say("\u0001" * 16384)  # six bytes each once encoded as JSON
    for n in range(200):
        turn.tool_call(f"t{n}", title="x" * 300, kind="read", status="completed")
    document = turn_document(turn, budget=8192)
    assert len(json.dumps(document).encode()) <= 8192
    assert document["said_bytes"] == 16384 and document["tool_calls"] == []
    assert document["text"] and turn.text.startswith(document["text"])
