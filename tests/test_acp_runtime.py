"""The ACP runtime in process (``workflow_delivery.acp.AcpAgent``) driving the scripted
agent (``tests/acp_agent.py``), a real process speaking ACP over stdio, with its MCP
tools called by the agent through a real MCP client session."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from django.db import connection

from tests import factories
from tests.consumers import status
from workflow_delivery.acp import AcpAgent
from workflow_delivery.protocol import DeliveryStatus
from workflow_delivery.services import send_message

pytestmark = pytest.mark.django_db(transaction=True)

AGENT = [sys.executable, str(Path(__file__).with_name("acp_agent.py"))]


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
