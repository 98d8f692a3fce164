"""Chaos for the ACP runtime: ``run_acp_agent`` as a subprocess, its scripted agent
and itself killed with SIGKILL at random points, the reaper run between rounds. Every
delivery settles once, and every reply the agent makes is stored once. The same for
API mode: ``python -m workflow_delivery.acp --api`` (without Django) against a real
uvicorn server, with a few kills here (``bench.acp_bench.api_chaos``; its longer run
is ``python -m bench.acp_bench --chaos-api 50``)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time

import pytest
from django.test import override_settings

from tests.acp.test_acp_api import RUNNER
from tests.acp.test_acp_command import command, environment
from tests.support import factories
from tests.support.agent_http import uvicorn_server
from workflow_delivery.models import Event, WorkflowAgentDelivery
from workflow_delivery.services import reap_expired_deliveries, send_message

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Rounds of kills (each kills the runtime, and the agent first half the time); the
# suite runs 4, ``ACP_CHAOS_ROUNDS`` asks for a longer run.
ROUNDS = int(os.environ.get("ACP_CHAOS_ROUNDS", "4"))
DELIVERIES = max(8, 2 * ROUNDS)
# The oldest deliveries are claimed, and killed, in round after round: an attempts cap
# above the rounds, so none is failed for having used them all.
MAX_ATTEMPTS = 2 * ROUNDS + 20


def agent_pids(log) -> set[int]:
    if not log.exists():
        return set()
    return {int(line.split()[0]) for line in log.read_text().splitlines() if line.strip()}


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=MAX_ATTEMPTS)
def test_kills_of_agent_and_runtime_settle_every_delivery_once(tmp_path):
    rng = random.Random(31)
    owner = factories.community()
    agent, peer = factories.key32(), factories.key32()
    factories.enroll(owner, [agent, peer])
    ids = [
        send_message(
            owner.id,
            targets=[agent],
            content=f"reply {peer.hex()} answer-{index}",
            idempotency_key=f"chaos-{index}",
        )
        .deliveries[0]
        .id
        for index in range(DELIVERIES)
    ]
    log = tmp_path / "turns.log"
    env = environment(
        ACP_AGENT_LOG=str(log),
        ACP_AGENT_DELAY="0.3",
        WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS="0.05",
        WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS="0.2",
        WORKFLOW_DELIVERY_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
    )
    kills = []
    for round_ in range(ROUNDS + 1):
        last = round_ == ROUNDS
        process = subprocess.Popen(
            command(owner, agent, "--lease-seconds", "1", "--concurrency", "2"),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            if last:
                # What the kills left: a second a delivery, two turns at a time.
                deadline = time.monotonic() + 30 + DELIVERIES
                while time.monotonic() < deadline:
                    reap_expired_deliveries()
                    if not WorkflowAgentDelivery.objects.filter(
                        id__in=ids, status__in=["pending", "claimed"]
                    ).exists():
                        break
                    time.sleep(0.2)
            else:
                # Kill mid-turn: once the runtime holds a delivery, at a random point.
                claimed = WorkflowAgentDelivery.objects.filter(id__in=ids, status="claimed")
                deadline = time.monotonic() + 15
                while not claimed.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.1, 0.7))
                if rng.random() < 0.5 and agent_pids(log):
                    victim = max(agent_pids(log))
                    kills.append("agent")
                    with_pid = victim
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(with_pid, signal.SIGKILL)
                    time.sleep(rng.uniform(0.3, 0.8))
                kills.append("runtime")
        finally:
            # The runtime and its agent: one process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(1.1)
        reap_expired_deliveries()
    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert sorted(row.status for row in rows) == ["finished"] * DELIVERIES
    for index in range(DELIVERIES):
        assert Event.objects.filter(content=f"answer-{index}").count() == 1
    # Every reply went to the peer exactly once.
    assert WorkflowAgentDelivery.objects.filter(target_pubkey=peer).count() == DELIVERIES
    assert "runtime" in kills
    # The kills fell mid-turn: some deliveries took more than one claim.
    assert sum(row.attempts for row in rows) > DELIVERIES
    print(
        f"{kills.count('agent')} agent and {kills.count('runtime')} runtime kills;"
        f" {DELIVERIES} deliveries finished once, {DELIVERIES} replies stored once;"
        f" {sum(row.attempts for row in rows) - DELIVERIES} claims beyond the first"
    )


# One kill of each (the first two kills are one of each): the longer run is the bench's.
API_KILLS = 2


@pytest.mark.psycopg3  # the bench's helpers and the server run on psycopg 3
def test_kills_of_agent_and_api_runtime_settle_every_delivery_once(tmp_path):
    from bench.acp_bench import CHAOS_SERVER_ENV, api_chaos

    with uvicorn_server(extra_env=CHAOS_SERVER_ENV) as url:
        found = api_chaos(
            f"{url}/agents/",
            API_KILLS,
            seed=37,
            runner=RUNNER,
            settle_seconds=30,
            output=tmp_path / "runtime.log",
        )
    log = (tmp_path / "runtime.log").read_text()[-3000:]
    deliveries = found["deliveries"]
    assert found["kills of the agent"] >= 1 and found["kills of the runtime"] >= 1, found
    assert found["statuses"] == {"finished": deliveries}, (found, log)
    # Every delivery settled once (one finished turn stored) and replied once.
    assert found["deliveries with one finished turn"] == deliveries, found
    assert found["deliveries with more than one"] == 0, found
    assert found["replies stored once"] == deliveries, found
    assert found["replies stored more than once"] == 0, found
    assert found["replies to the peer"] == deliveries, found
    # The kills fell mid-turn: some deliveries took more than one claim.
    assert found["claims beyond the first"] > 0, found
