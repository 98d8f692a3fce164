"""Benchmarks of the ACP runtime (``workflow_delivery.acp``) against the tests'
scripted agent, in a scratch database of its own (``bench.common.bench_database``).

In process (``AcpAgent``, the default):

- turn ended -> delivery settled, p99 (from the handler seeing the stop reason to the
  settle's commit);
- the runtime's own cost per delivery, p50: time per delivery of ``AcpAgent`` with an
  agent that answers at once (the scripted agent's ``answer``: one chunk of text,
  then ``end_turn``; no MCP call), minus the same of a plain ``Consumer`` whose
  handler returns at once, both measured in this run (the baseline). What is left
  is the runtime's share (the message read, ``session/new`` and ``session/prompt``
  round trips to the agent process, the hops between the handler's thread and the
  loop, the transcript stored with the settle);
- a turn 3x longer than the lease: settled finished, claimed once;
- lease lost (the key revoked) -> ``session/cancel`` sent, and no reply committed
  after the loss.

``--api``: the same figures for API mode (``ApiAgent``, what ``python -m
workflow_delivery.acp --api`` runs), its leases from a real uvicorn server serving
the demo project over the scratch database (``bench.common.api_server``): turn ended
(the verdict) -> the settle's answer, p99; per delivery p50 of ``ApiAgent`` against
a plain HTTP agent (an ``AgentClient`` claiming and finishing, the same requests
minus the turn) in the same run; the long turn (renewed through the API); the key
revoked -> the renew refused -> ``session/cancel``.

``--chaos-api KILLS``: API mode's chaos (``api_chaos``, which
``tests/harness/test_chaos_acp.py`` runs with a few kills): ``python -m workflow_delivery.acp
--api`` started against the server, its agent process and itself killed with
SIGKILL ``KILLS`` times, each mid-turn at a random point, the reaper run after a
runtime's death; then every delivery must have settled finished once, and every
reply be stored once. In-process kills are ``tests/harness/test_chaos_acp.py``.

Usage: ``python -m bench.acp_bench [--deliveries N] [--api] [--chaos-api KILLS
[--seed N]]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parent.parent
AGENT = [sys.executable, str(ROOT / "tests" / "support" / "acp_agent.py")]
# The runtime of API mode, as an agent's machine runs it.
API_RUNNER = [sys.executable, "-m", "workflow_delivery.acp"]
# Seconds the agent has to answer initialize: its interpreter starts and imports two
# SDKs, which a loaded machine makes slow.
HANDSHAKE = 60
SECRET_VARIABLE = "WD_BENCH_AGENT_SECRET"
# The server's retry backoff in the chaos run: a killed agent's turn is retried soon.
CHAOS_SERVER_ENV = {
    "WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS": "0.05",
    "WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS": "0.2",
}


def _setup(label: str, count: int, content: str, agent: bytes | None = None):
    from workflow_delivery.models import Community
    from workflow_delivery.services import enroll_agents, send_message

    owner = Community.objects.create(host=f"{label}-{uuid.uuid4().hex[:8]}.bench")
    agent, peer = agent or os.urandom(32), os.urandom(32)
    enroll_agents(owner.id, [agent, peer])
    ids = [
        send_message(owner.id, targets=[agent], content=content, idempotency_key=f"{label}-{i}")
        .deliveries[0]
        .id
        for i in range(count)
    ]
    return owner, agent, peer, ids


def _run_until(runner, stop_when) -> float:
    """``runner.run()`` on a thread until ``stop_when()``; a runner that ends first
    (its agent did not start, say) ends the benchmark with its error."""
    started = time.monotonic()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not stop_when():
        if not thread.is_alive():
            raise SystemExit(f"the runtime stopped early: {failed[0] if failed else 'no error'}")
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
    runner = AcpAgent(
        owner.id,
        agent,
        AGENT,
        handshake_timeout=HANDSHAKE,
        max_deliveries=count,
        poll_interval=0.05,
    )
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
    runner = AcpAgent(
        owner.id, agent, AGENT, handshake_timeout=HANDSHAKE, lease_seconds=1, max_deliveries=1
    )
    runner.run()
    record = get_delivery(owner.id, delivery)
    return {"3x lease: status": record.status.value, "3x lease: claims": record.attempts}


def lease_lost() -> dict[str, object]:
    from workflow_delivery.acp import AcpAgent
    from workflow_delivery.models import Event
    from workflow_delivery.services import get_delivery, revoke_agent

    owner, agent, peer, [delivery] = _setup("lost", 1, "placeholder")
    Event.objects.filter(community_id=owner.id).update(content=f"hang-reply {peer.hex()}")
    runner = AcpAgent(
        owner.id, agent, AGENT, handshake_timeout=HANDSHAKE, lease_seconds=30, poll_interval=0.05
    )
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


# -- API mode ---------------------------------------------------------------------------


def _client(api: str, secret: bytes, host: str):
    """A client of the community at ``host``, its requests sent to the server at
    ``api`` (``http://127.0.0.1:PORT``), signed for ``host``."""
    from urllib.parse import urlsplit

    from workflow_delivery.client import AgentClient

    port = urlsplit(api).port
    return AgentClient(f"http://{host}/agents/", secret, connect_to=("127.0.0.1", port))


def _api_agent(api: str, secret: bytes, host: str, **options):
    from workflow_delivery.acp import ApiAgent

    options.setdefault("wait_seconds", 1)
    options.setdefault("handshake_timeout", HANDSHAKE)
    return ApiAgent(lambda: _client(api, secret, host), AGENT, **options)


def _keyed(label: str, count: int, content: str):
    from workflow_delivery.keys import public_key_bytes

    secret = os.urandom(32)
    owner, _, peer, ids = _setup(label, count, content, public_key_bytes(secret))
    return owner, secret, peer, ids


def _plain_http_gaps(api: str, count: int) -> list[float]:
    """Time per delivery of a plain HTTP agent: claim (``wait``, as ``ApiAgent``
    claims), then finish, through the signed client."""
    owner, secret, _, _ids = _keyed("api-base", count, "answer")
    stamps: list[float] = []
    with _client(api, secret, owner.host) as client:
        while len(stamps) < count:
            claimed = client.claim(lease_seconds=30, wait=1)
            if claimed is None:
                raise SystemExit(f"the plain HTTP agent found {len(stamps)} of {count}")
            client.finish(claimed.lease, "finished")
            stamps.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(stamps)]


def api_settle_latency_and_cost(api: str, count: int) -> dict[str, float]:
    # The baseline's halves before and after the runtime's run: a machine whose load
    # drifts weighs on both sides alike.
    base_gaps = _plain_http_gaps(api, count // 2)
    owner, secret, _, _ids = _keyed("api-acp", count, "answer")
    runner = _api_agent(api, secret, owner.host, max_deliveries=count)
    settled: list[float] = []
    per_turn: list[float] = []
    original = runner._settle

    def timed_settle(client, lease, found, turn=None):
        ended = time.monotonic()
        original(client, lease, found, turn)
        now = time.monotonic()
        settled.append(now - ended)
        per_turn.append(now)

    runner._settle = timed_settle
    stats = runner.run()
    if stats.finished != count:
        raise SystemExit(f"API mode settled {stats.line()} of {count} deliveries")
    base_gaps += _plain_http_gaps(api, count - count // 2)
    gaps = [b - a for a, b in itertools.pairwise(per_turn)]
    return {
        "API: turn ended -> settled p99 (ms)": 1000 * common.percentile(settled, 99),
        "API: per delivery p50, ACP (ms)": 1000 * common.percentile(gaps, 50),
        "API: per delivery p50, plain HTTP agent (ms)": 1000 * common.percentile(base_gaps, 50),
        "API: runtime's own cost p50 (ms)": 1000
        * (common.percentile(gaps, 50) - common.percentile(base_gaps, 50)),
    }


def api_long_turn(api: str) -> dict[str, object]:
    from workflow_delivery.services import get_delivery

    owner, secret, _, [delivery] = _keyed("api-long", 1, "sleep 3")
    runner = _api_agent(api, secret, owner.host, lease_seconds=1, max_deliveries=1)
    runner.run()
    record = get_delivery(owner.id, delivery)
    return {"API: 3x lease: status": record.status.value, "API: 3x lease: claims": record.attempts}


def api_lease_lost(api: str) -> dict[str, object]:
    from workflow_delivery.keys import public_key_bytes
    from workflow_delivery.models import Event
    from workflow_delivery.services import get_delivery, revoke_agent

    owner, secret, peer, [delivery] = _keyed("api-lost", 1, "placeholder")
    Event.objects.filter(community_id=owner.id).update(content=f"hang-reply {peer.hex()}")
    runner = _api_agent(api, secret, owner.host, lease_seconds=30)
    revoked = [0.0]

    def claimed() -> bool:
        record = get_delivery(owner.id, delivery)
        if record.status.value == "claimed" and not revoked[0]:
            time.sleep(0.2)
            revoke_agent(owner.id, public_key_bytes(secret))
            revoked[0] = time.monotonic()
        return bool(revoked[0] and runner.cancelled_at)

    _run_until(runner, claimed)
    return {
        "API: lease lost -> cancel (ms)": 1000 * (runner.cancelled_at[0] - revoked[0]),
        "API: replies committed after the loss": Event.objects.filter(
            community_id=owner.id, content="late"
        ).count(),
    }


# -- API mode's chaos -----------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its agent), from /proc."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
    return found


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def api_chaos(
    api: str,
    kills: int,
    *,
    seed: int,
    runner: Sequence[str] = API_RUNNER,
    batch: int = 4,
    lease_seconds: int = 1,
    settle_seconds: float = 60.0,
    output: Path | None = None,
) -> dict[str, object]:
    """Kill API mode ``kills`` times (see the module's docstring) and report what the
    database holds. The community, its agent and a peer are made here; deliveries
    (each ``reply <peer> answer-<n>``) are sent ``batch`` at a time whenever none is
    left to work on, so every kill falls on a runtime holding one. Each kill is of
    the agent process (the runtime starts another for its next turn) or of the
    runtime (``runner``, SIGKILL; then its process group, the agent with it), the
    first two one of each, the rest chosen at random; after a runtime's death its
    leases run out and the reaper takes them back. Needs Django set up (the
    database of the server at ``api``) and the server's retry backoff short
    (``CHAOS_SERVER_ENV``)."""
    from urllib.parse import urlsplit

    from django.db.models import Count

    from workflow_delivery.keys import public_key_bytes
    from workflow_delivery.models import AgentTurn, Community, Event, WorkflowAgentDelivery
    from workflow_delivery.services import enroll_agents, reap_expired_deliveries, send_message

    rng = random.Random(seed)
    # The runtime's command names the server's own host: the community is served there.
    owner = Community.objects.create(host=urlsplit(api).hostname)
    secret, peer = os.urandom(32), os.urandom(32)
    agent = public_key_bytes(secret)
    enroll_agents(owner.id, [agent, peer])
    ids: list[uuid.UUID] = []
    rows = WorkflowAgentDelivery.objects.filter(community_id=owner.id, target_pubkey=agent)
    open_rows = rows.filter(status__in=["pending", "claimed"])
    command = [
        *runner,
        "--api",
        api,
        "--secret-env",
        SECRET_VARIABLE,
        "--lease-seconds",
        str(lease_seconds),
        "--concurrency",
        "2",
        "--wait",
        "1",
        "--handshake-timeout",
        str(HANDSHAKE),
        "--",
        *AGENT,
    ]
    # The agent notes each turn it begins in this file (``tests/support/acp_agent.py``).
    turns = (output.parent if output is not None else Path(tempfile.mkdtemp())) / "turns.log"
    env = {
        **os.environ,
        SECRET_VARIABLE: secret.hex(),
        "ACP_AGENT_DELAY": "0.3",
        "ACP_AGENT_LOG": str(turns),
    }
    log = open(output, "ab") if output is not None else subprocess.DEVNULL  # noqa: SIM115

    def top_up() -> None:
        for _ in range(batch):
            content = f"reply {peer.hex()} answer-{len(ids)}"
            sent = send_message(
                owner.id, targets=[agent], content=content, idempotency_key=f"chaos-{len(ids)}"
            )
            ids.append(sent.deliveries[0].id)

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
            # A child of a background run may inherit SIGINT ignored: set it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    def end(process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    killed = {"agent": 0, "runtime": 0}
    misses = 0
    started = time.monotonic()
    process: subprocess.Popen | None = None
    try:
        while sum(killed.values()) < kills:
            if process is None:
                process = start()
            # Mid-turn: once the agent has begun a turn (its log has a new line; a
            # starting agent is not yet in one), more sent whenever none is left.
            # The kill falls in one of the next four turns, so some end between kills.
            begun = _lines(turns) + rng.randint(0, 3)
            deadline = time.monotonic() + 60
            while _lines(turns) <= begun:
                if not open_rows.exists():
                    top_up()
                if time.monotonic() > deadline or process.poll() is not None:
                    states = list(open_rows.values_list("status", "attempts", "available_at"))
                    raise RuntimeError(
                        f"no turn began in 60 s (the runtime's exit status {process.poll()}; "
                        f"open deliveries {states}; its output in {output})"
                    )
                time.sleep(0.02)
            time.sleep(rng.uniform(0.1, 0.7))
            done = sum(killed.values())
            victim = ("agent", "runtime")[done] if done < 2 else rng.choice(("agent", "runtime"))
            agents = _children(process.pid) if victim == "agent" else []
            if victim == "agent" and not agents:
                misses += 1  # between an agent's death and the next one's start
                continue
            for pid in agents:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if victim == "runtime":
                os.kill(process.pid, signal.SIGKILL)
                end(process)
                process = None
                time.sleep(lease_seconds + 0.1)
                reap_expired_deliveries()
            killed[victim] += 1
        if process is None:
            process = start()
        deadline = time.monotonic() + settle_seconds
        while open_rows.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
            reap_expired_deliveries()
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(15)
            end(process)
        if output is not None:
            log.close()
    statuses = collections.Counter(rows.filter(id__in=ids).values_list("status", flat=True))
    replies = collections.Counter(
        Event.objects.filter(community_id=owner.id, content__startswith="answer-").values_list(
            "content", flat=True
        )
    )
    finished_turns = collections.Counter(
        AgentTurn.objects.filter(delivery_id__in=ids, outcome="finished")
        .values("delivery_id")
        .annotate(n=Count("id"))
        .values_list("n", flat=True)
    )
    claims = sum(rows.filter(id__in=ids).values_list("attempts", flat=True))
    return {
        "kills of the agent": killed["agent"],
        "kills of the runtime": killed["runtime"],
        "deliveries": len(ids),
        "statuses": dict(statuses),
        "replies stored once": sum(1 for n in replies.values() if n == 1),
        "replies stored more than once": sum(1 for n in replies.values() if n > 1),
        "replies to the peer": WorkflowAgentDelivery.objects.filter(
            community_id=owner.id, target_pubkey=peer
        ).count(),
        "deliveries with one finished turn": finished_turns.get(1, 0),
        "deliveries with more than one": sum(n for k, n in finished_turns.items() if k > 1),
        "claims beyond the first": claims - len(ids),
        "kill rounds without an agent to kill": misses,
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=200)
    parser.add_argument("--api", action="store_true", help="API mode's figures")
    parser.add_argument("--chaos-api", type=int, metavar="KILLS", help="API mode's chaos run")
    parser.add_argument("--seed", type=int, help="the chaos run's (default: random)")
    options = parser.parse_args()
    figures: dict[str, object] = {}
    with common.bench_database("buzz_bench_acp", quiet=True) as db:
        if options.chaos_api:
            seed = options.seed if options.seed is not None else random.randrange(2**31)
            figures["seed"] = seed
            # Kept after the run: what the runtimes logged, to read when it fails.
            output = Path(tempfile.mkdtemp(prefix="acp-chaos-")) / "runtime.log"
            figures["the runtimes' output"] = str(output)
            with common.api_server(common.database_url(db), env=CHAOS_SERVER_ENV) as url:
                figures.update(
                    api_chaos(f"{url}/agents/", options.chaos_api, seed=seed, output=output)
                )
        elif options.api:
            with common.api_server(common.database_url(db)) as api:
                figures.update(api_settle_latency_and_cost(api, options.deliveries))
                figures.update(api_long_turn(api))
                figures.update(api_lease_lost(api))
        else:
            figures.update(settle_latency_and_cost(options.deliveries))
            figures.update(long_turn())
            figures.update(lease_lost())
    for name, value in figures.items():
        shown = f"{value:.2f}" if isinstance(value, float) else value
        print(f"{name}: {shown}")


if __name__ == "__main__":
    main()
