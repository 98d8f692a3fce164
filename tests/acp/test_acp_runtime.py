"""The ACP runtime in process (``workflow_delivery.acp.AcpAgent``) driving the scripted
agent (``tests/support/acp_agent.py``), a real process speaking ACP over stdio, with its MCP
tools called by the agent through a real MCP client session."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test import override_settings

from tests.support import SUPPORT, admin_pages, factories
from tests.support.consumers import eventually, status
from workflow_delivery.acp import AcpAgent, AgentStartError, Turn, turns
from workflow_delivery.models import Event, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus
from workflow_delivery.services import get_delivery, revoke_agent, send_message

pytestmark = pytest.mark.django_db(transaction=True)

AGENT = [sys.executable, str(SUPPORT / "acp_agent.py")]


@pytest.fixture
def roster():
    owner = factories.community()
    agent, peer = factories.key32(), factories.key32()
    factories.enroll(owner, [agent, peer])
    return owner, agent, peer


def send(owner, agent, content: str, key: str = "k1", run_id=None):
    sent = send_message(
        owner.id, targets=[agent], content=content, idempotency_key=key, run_id=run_id
    )
    return sent.deliveries[0].id


def acp_agent(owner, agent, **options) -> AcpAgent:
    options.setdefault("lease_seconds", 2)
    options.setdefault("poll_interval", 0.1)
    options.setdefault("grace_seconds", 2.0)
    # Generous on a loaded machine: the agent's interpreter starts and imports two SDKs.
    options.setdefault("handshake_timeout", 60)
    return AcpAgent(owner.id, agent, options.pop("command", AGENT), **options)


def settled(delivery_id) -> DeliveryStatus | None:
    found = status(delivery_id)
    return found if found in (DeliveryStatus.FINISHED, DeliveryStatus.FAILED) else None


class Driving:
    """``AcpAgent.run()`` on a thread of the test; stopped and joined on exit."""

    def __init__(self, runner: AcpAgent) -> None:
        self.runner = runner
        self.stats = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.stats = self.runner.run()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        finally:
            connection.close()

    def __enter__(self) -> Driving:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.stop()
        self.join()

    def join(self, timeout: float = 30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the runtime did not stop"
        return self.stats


def test_end_turn_settles_finished(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "answer hello")
    stats = Driving(acp_agent(owner, agent, max_deliveries=1)).__enter__().join()
    assert status(delivery) is DeliveryStatus.FINISHED
    assert stats.finished == 1 and stats.claimed == 1


def record(owner, delivery_id):
    return get_delivery(owner.id, delivery_id)


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS=60)
def test_stop_reasons_map_to_settlements(roster):
    owner, agent, _ = roster
    sent = {
        word: send(owner, agent, word, key=f"k-{index}")
        for index, word in enumerate(
            ["answer hi", "stream 5", "refuse", "max_tokens", "max_turn_requests", "fail no way"]
        )
    }
    with Driving(acp_agent(owner, agent, concurrency=3)) as driving:
        assert eventually(lambda: all(settled(d) for d in sent.values()), 60)
    assert driving.error is None
    assert status(sent["answer hi"]) is DeliveryStatus.FINISHED
    assert status(sent["stream 5"]) is DeliveryStatus.FINISHED
    for word in ("refuse", "max_tokens", "max_turn_requests"):
        found = record(owner, sent[word])
        assert found.status is DeliveryStatus.FAILED, word
        # Failed at once: one claim, the reason kept.
        assert found.attempts == 1
        reason = "refusal" if word == "refuse" else word
        assert reason in found.last_error.message
    failed = record(owner, sent["fail no way"])
    assert failed.status is DeliveryStatus.FAILED and "no way" in failed.last_error.message


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS=60)
def test_agent_dying_mid_turn_is_retried_and_the_agent_restarted(roster, tmp_path):
    owner, agent, _ = roster
    log = tmp_path / "turns.log"
    crashed = send(owner, agent, "crash", key="k-crash")
    runner = acp_agent(owner, agent, env={**os.environ, "ACP_AGENT_LOG": str(log)})
    with Driving(runner):
        assert eventually(lambda: record(owner, crashed).last_error is not None, 60)
        after = send(owner, agent, "answer still here", key="k-after")
        assert eventually(lambda: settled(after), 60)
    found = record(owner, crashed)
    assert found.status is DeliveryStatus.PENDING and found.available_at is not None
    assert "exit status 3" in found.last_error.message
    assert status(after) is DeliveryStatus.FINISHED
    pids = {line.split()[0] for line in log.read_text().splitlines()}
    assert len(pids) == 2 and runner.runtime.restarts == 1


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS=60)
def test_turn_timeout_cancels_and_retries(roster):
    owner, agent, _ = roster
    hung = send(owner, agent, "hang", key="k-hang")
    runner = acp_agent(owner, agent, turn_timeout=0.5)
    with Driving(runner):
        assert eventually(lambda: record(owner, hung).last_error is not None, 60)
    found = record(owner, hung)
    assert found.status is DeliveryStatus.PENDING
    assert found.last_error.type.endswith("TurnTimeout")
    # The agent ended the cancelled turn itself: it was not restarted.
    assert runner.runtime.restarts == 0


def test_a_turn_longer_than_the_lease_is_renewed_and_finishes(roster):
    owner, agent, _ = roster
    slow = send(owner, agent, "sleep 3", key="k-slow")
    with Driving(acp_agent(owner, agent, lease_seconds=1, max_deliveries=1)) as driving:
        assert eventually(lambda: settled(slow), 60)
    found = record(owner, slow)
    assert found.status is DeliveryStatus.FINISHED and found.attempts == 1
    assert driving.runner.consumer.stats.renewed >= 2


def test_lost_lease_cancels_the_turn_within_a_second(roster):
    owner, agent, peer = roster
    hung = send(owner, agent, f"hang-reply {peer.hex()}", key="k-lost")
    runner = acp_agent(owner, agent, lease_seconds=30)
    with Driving(runner):
        assert eventually(lambda: status(hung) is DeliveryStatus.CLAIMED, 60)
        time.sleep(0.3)
        revoke_agent(owner.id, agent)
        revoked_at = time.monotonic()
        assert eventually(lambda: runner.handler.cancelled_at, 5)
        assert runner.handler.cancelled_at[0] - revoked_at < 1.0
        time.sleep(0.5)
    assert runner.consumer.stats.lost == 1
    # The agent's reply after the cancel (the late effect) was refused: nothing stored.
    assert not Event.objects.filter(content="late").exists()
    assert status(hung) is DeliveryStatus.PENDING


def replies_to(peer: bytes) -> list[Event]:
    return list(Event.objects.filter(tags__contains=[["p", peer.hex(), "", "message-v1"]]))


def test_reply_over_mcp_is_stored_once_in_the_run_and_delivered(roster, client, viewer):
    viewer_client = client
    owner, agent, peer = roster
    delivery = send(owner, agent, f"reply-twice {peer.hex()} thanks, done", key="k-reply")
    with Driving(acp_agent(owner, agent, max_deliveries=1)):
        assert eventually(lambda: settled(delivery), 60)
    assert status(delivery) is DeliveryStatus.FINISHED
    [reply] = replies_to(peer)
    assert reply.content == "thanks, done" and bytes(reply.pubkey) == agent
    asked = record(owner, delivery)
    assert ["run", str(asked.binding.run_id)] == reply.tags[1][:2]
    assert ["e", asked.binding.message_event_id.hex(), "", "reply"] in reply.tags
    # Sent to the peer: one delivery of the reply, in the same run.
    [sent] = WorkflowAgentDelivery.objects.filter(target_pubkey=peer)
    assert sent.run_id == asked.binding.run_id
    # Shown on the delivery's admin page.
    page = viewer_client.get(admin_pages.change(WorkflowAgentDelivery, delivery))
    assert page.status_code == 200
    assert f"<code>{agent.hex()[:12]}</code>: thanks, done" in page.content.decode()


@override_settings(WORKFLOW_DELIVERY_ACP_REPLY_BYTES=10)
def test_bad_replies_are_tool_errors_and_store_nothing(roster):
    owner, agent, peer = roster
    stranger = factories.key32()
    too_long = send(owner, agent, f"reply {peer.hex()} far more than ten bytes", key="k-long")
    outsider = send(owner, agent, f"reply {stranger.hex()} hi", key="k-out")
    with Driving(acp_agent(owner, agent, concurrency=2)):
        assert eventually(lambda: settled(too_long) and settled(outsider), 60)
    assert not replies_to(peer) and not replies_to(stranger)
    assert not WorkflowAgentDelivery.objects.filter(target_pubkey__in=[peer, stranger]).exists()


def test_an_agent_that_never_answers_initialize_is_a_clear_error(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "answer")
    runner = acp_agent(
        owner, agent, handshake_timeout=0.5, env={**os.environ, "ACP_AGENT_MODE": "mute"}
    )
    with pytest.raises(AgentStartError, match=r"did not answer initialize within 0\.5 s"):
        runner.run()
    assert record(owner, delivery).attempts == 0


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS=60)
def test_a_malformed_frame_retries_the_delivery_and_the_runtime_survives(roster):
    owner, agent, _ = roster
    broken = send(owner, agent, "malformed", key="k-bad")
    runner = acp_agent(owner, agent, turn_timeout=0.5)
    with Driving(runner):
        assert eventually(lambda: record(owner, broken).last_error is not None, 60)
        after = send(owner, agent, "answer", key="k-after")
        assert eventually(lambda: settled(after), 60)
    assert record(owner, broken).status is DeliveryStatus.PENDING
    assert status(after) is DeliveryStatus.FINISHED


@override_settings(WORKFLOW_DELIVERY_ACP_ALLOW_PERMISSIONS=("read",))
def test_permission_requests_are_denied_unless_allowed_and_the_turn_is_kept(roster):
    owner, agent, _ = roster
    asked = send(owner, agent, "permission delete everything", key="k-perm")
    streamed = send(owner, agent, "stream 3", key="k-stream")
    runner = acp_agent(owner, agent)
    turns = {}
    runner.handler.on_turn = lambda context, turn, verdict: turns.update({turn.delivery_id: turn})
    with Driving(runner):
        assert eventually(lambda: settled(asked) and settled(streamed), 60)
    assert '"optionId": "deny"' in turns[asked].text or '"option_id": "deny"' in turns[asked].text
    [request] = turns[asked].permissions
    assert (request["title"], request["kind"], request["answer"]) == (
        "delete everything",
        "edit",
        "denied",
    )
    assert turns[streamed].text == "chunk 0 chunk 1 chunk 2 "


class _CountingJobs:
    """A turn's job queue that notes each wait that ran out (a poll waited out)."""

    def __init__(self) -> None:
        self.inner: queue.SimpleQueue = queue.SimpleQueue()
        self.ran_out = 0

    def put(self, item: object) -> None:
        self.inner.put(item)

    def get(self, timeout: float | None = None) -> object:
        try:
            return self.inner.get(timeout=timeout)
        except queue.Empty:
            self.ran_out += 1
            raise

    def get_nowait(self) -> object:
        return self.inner.get_nowait()


def test_the_turns_end_wakes_the_waiting_thread_instead_of_its_poll(monkeypatch):
    """``drive`` returns the moment the turn's future is done: with a poll of 30 s, no
    wait of the handler's thread runs out, and closing the turn drains the wake-up."""
    monkeypatch.setattr(turns, "POLL", 30.0)

    class Runtime:
        def turn(self, turn):
            future = concurrent.futures.Future()
            threading.Timer(0.05, future.set_result, ["end_turn"]).start()
            return future

    turn = Turn(run_id=uuid.uuid4(), delivery_id=uuid.uuid4(), blocks=[], max_bytes=100)
    turn.jobs = jobs = _CountingJobs()
    source = SimpleNamespace(lost=threading.Event(), stopping=threading.Event(), live=lambda: True)
    assert turns.drive(Runtime(), turn, source) is None
    assert turn.result.result(timeout=0) == "end_turn"
    assert jobs.ran_out == 0
    assert turn.call(lambda: None).exception(timeout=0) is not None
