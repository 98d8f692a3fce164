"""``manage.py run_acp_agent`` as a subprocess driving the scripted ACP agent
(``tests/support/acp_agent.py``): bad agents are clear errors before any claim, SIGTERM
gives the turn's lease back and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import SUPPORT, factories
from tests.support.agent_http import database_url
from tests.support.consumers import eventually, status
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus
from workflow_delivery.services import send_message

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
AGENT = [sys.executable, str(SUPPORT / "acp_agent.py")]


@pytest.fixture
def pending():
    owner = factories.community()
    agent = factories.key32()
    factories.enroll(owner, [agent])
    sent = send_message(owner.id, targets=[agent], content="hang", idempotency_key="k")
    return owner, agent, sent.deliveries[0].id


def command(owner, agent, *extra: str, agent_command=AGENT) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "manage.py"),
        "run_acp_agent",
        "--community",
        owner.host,
        "--agent",
        agent.hex(),
        "--lease-seconds",
        "5",
        "--poll-interval",
        "0.2",
        "--handshake-timeout",
        "60",
        *extra,
        "--",
        *agent_command,
    ]


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url(), **extra}


@pytest.mark.parametrize(
    ("agent_command", "mode", "expected"),
    [
        (["/nonexistent/acp-agent"], "", "cannot start the agent '/nonexistent/acp-agent'"),
        (AGENT, "exit", "failed to initialise (exit status 2)"),
        (AGENT, "bad-version", "speaks ACP protocol version 42; this runtime speaks 1"),
    ],
)
def test_an_agent_that_cannot_start_is_a_clear_error_and_claims_nothing(
    pending, agent_command, mode, expected
):
    owner, agent, delivery = pending
    result = subprocess.run(
        command(owner, agent, agent_command=agent_command),
        env=environment(ACP_AGENT_MODE=mode),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert expected in result.stderr
    row = WorkflowAgentDelivery.objects.get(id=delivery)
    assert row.status == "pending" and row.attempts == 0


def test_the_handshake_timeout_is_an_option(pending):
    owner, agent, delivery = pending
    result = subprocess.run(
        [*command(owner, agent)[:-3], "--handshake-timeout", "0.5", "--", *AGENT],
        env=environment(ACP_AGENT_MODE="mute"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "did not answer initialize within 0.5 s" in result.stderr
    assert WorkflowAgentDelivery.objects.get(id=delivery).attempts == 0


def test_sigterm_cancels_the_turn_releases_its_lease_and_exits_zero(pending):
    owner, agent, delivery = pending
    process = subprocess.Popen(
        command(owner, agent),
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A child of a background test run may inherit SIGINT ignored: set it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert eventually(lambda: status(delivery) is DeliveryStatus.CLAIMED, 60)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "stopped by SIGTERM" in out and "released=1" in out
    row = WorkflowAgentDelivery.objects.get(id=delivery)
    assert row.status == "pending" and row.lease_generation == 2
