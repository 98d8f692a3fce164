"""Benchmarks of the ACP runtime (``workflow_delivery.acp``) against the tests'
scripted agent, in a scratch database of its own (``bench.common.bench_database``):

- turn ended -> delivery settled, p99 (from the handler seeing the stop reason to the
  settle's commit);
- the runtime's own cost per delivery, p50: time per delivery of ``AcpAgent`` with an
  agent that answers at once, minus the same of a plain ``Consumer`` whose handler
  returns at once, both measured in this run (the baseline);
- a turn 3x longer than the lease: settled finished, claimed once;
- lease lost (the key revoked) -> ``session/cancel`` sent, and no reply committed
  after the loss.

Kills of the agent and of the runtime are ``tests/harness/test_chaos_acp.py`` (``--kills``
here would repeat it). Usage: ``python -m bench.acp_bench [--deliveries N]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parent.parent
AGENT = [sys.executable, str(ROOT / "tests" / "support" / "acp_agent.py")]


def _setup(label: str, count: int, content: str):
    from workflow_delivery.models import Community
    from workflow_delivery.services import enroll_agents, send_message

    owner = Community.objects.create(host=f"{label}-{uuid.uuid4().hex[:8]}.bench")
    agent, peer = os.urandom(32), os.urandom(32)
    enroll_agents(owner.id, [agent, peer])
    ids = [
        send_message(owner.id, targets=[agent], content=content, idempotency_key=f"{label}-{i}")
        .deliveries[0]
        .id
        for i in range(count)
    ]
    return owner, agent, peer, ids


def _run_until(runner, stop_when) -> float:
    started = time.monotonic()
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    while not stop_when():
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    runner.stop()
    thread.join(30)
    return elapsed


def settle_latency_and_cost(count: int) -> dict[str, float]:
    from workflow_delivery.acp import AcpAgent
    from workflow_delivery.consumer import Consumer

    owner, agent, _, _ids = _setup("base", count, "answer")
    per_base: list[float] = []
    last = [time.monotonic()]

    def handler(record, lease, context):
        now = time.monotonic()
        per_base.append(now - last[0])
        last[0] = now

    base = Consumer(owner.id, [agent], handler, max_deliveries=count, poll_interval=0.05)
    base.run()

    owner, agent, _, _ids = _setup("acp", count, "answer")
    runner = AcpAgent(owner.id, agent, AGENT, max_deliveries=count, poll_interval=0.05)
    ended: dict[uuid.UUID, float] = {}
    settled: list[float] = []
    per_turn: list[float] = []
    runner.handler.on_turn = lambda context, turn, verdict: ended.__setitem__(
        turn.delivery_id, time.monotonic()
    )
    original = runner.consumer._settle

    def timed_settle(context, outcome, error=None, **options):
        claimed = original(context, outcome, error, **options)
        now = time.monotonic()
        settled.append(now - ended[context.lease.delivery_id])
        per_turn.append(now)
        return claimed

    runner.consumer._settle = timed_settle
    runner.run()
    if len(settled) != count:
        raise SystemExit(f"the ACP runtime settled {len(settled)} of {count} deliveries")
    gaps = [b - a for a, b in itertools.pairwise(per_turn)]
    base_gaps = per_base[1:]
    return {
        "turn ended -> settled p99 (ms)": 1000 * common.percentile(settled, 99),
        "per delivery p50, ACP (ms)": 1000 * common.percentile(gaps, 50),
        "per delivery p50, plain consumer (ms)": 1000 * common.percentile(base_gaps, 50),
        "runtime's own cost p50 (ms)": 1000
        * (common.percentile(gaps, 50) - common.percentile(base_gaps, 50)),
    }


def long_turn() -> dict[str, object]:
    from workflow_delivery.acp import AcpAgent
    from workflow_delivery.services import get_delivery

    owner, agent, _, [delivery] = _setup("long", 1, "sleep 3")
    runner = AcpAgent(owner.id, agent, AGENT, lease_seconds=1, max_deliveries=1)
    runner.run()
    record = get_delivery(owner.id, delivery)
    return {"3x lease: status": record.status.value, "3x lease: claims": record.attempts}


def lease_lost() -> dict[str, object]:
    from workflow_delivery.acp import AcpAgent
    from workflow_delivery.models import Event
    from workflow_delivery.services import get_delivery, revoke_agent

    owner, agent, peer, [delivery] = _setup("lost", 1, "placeholder")
    Event.objects.filter(community_id=owner.id).update(content=f"hang-reply {peer.hex()}")
    runner = AcpAgent(owner.id, agent, AGENT, lease_seconds=30, poll_interval=0.05)
    revoked = [0.0]

    def claimed() -> bool:
        record = get_delivery(owner.id, delivery)
        if record.status.value == "claimed" and not revoked[0]:
            time.sleep(0.2)
            revoke_agent(owner.id, agent)
            revoked[0] = time.monotonic()
        return bool(revoked[0] and runner.handler.cancelled_at)

    _run_until(runner, claimed)
    return {
        "lease lost -> cancel (ms)": 1000 * (runner.handler.cancelled_at[0] - revoked[0]),
        "replies committed after the loss": Event.objects.filter(content="late").count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=200)
    options = parser.parse_args()
    with common.bench_database("buzz_bench_acp", quiet=True):
        figures: dict[str, object] = {}
        figures.update(settle_latency_and_cost(options.deliveries))
        figures.update(long_turn())
        figures.update(lease_lost())
    for name, value in figures.items():
        shown = f"{value:.2f}" if isinstance(value, float) else value
        print(f"{name}: {shown}")


if __name__ == "__main__":
    main()
