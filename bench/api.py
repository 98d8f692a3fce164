"""The agent HTTP API: claim+finish over HTTP against the same agents calling the
services in-process, under gunicorn (WSGI) and uvicorn (ASGI); the batch endpoints;
how soon a ``wait`` is woken; the per-request cost of NIP-98 verification and the
replay-guard insert.

    .venv/bin/python bench/api.py                          # both servers, 3 runs, 8 agents
    .venv/bin/python bench/api.py --server gunicorn --runs 1
    .venv/bin/python bench/api.py --seconds 1 --rows 500 --agents 2 --server-workers 1

Creates its own database (``<prefix>_<pid>``), migrates, seeds pending deliveries
round-robin over the agents' keys, and drops it at the end (also on Ctrl-C/SIGTERM).
The servers are the demo project on loopback with ``--server-workers`` worker
processes each (gunicorn: gthread, 4 threads a worker; uvicorn: the project's
``asgi.py``), both started once. Each run measures, per server, an in-process phase
and then the HTTP phase from the same seed, so a busy machine loads both alike; the
ratio is HTTP deliveries/s over in-process claim+finish cycles/s of that pair. The
batch line claims and finishes ``--batch`` deliveries per request. Each side runs
``--agents`` processes that start together on a barrier; only cycles that end inside
the measured window count. Each side's CPU per cycle is reported too: the agents'
own processes, and the rest of the machine (the server, PostgreSQL, anything else
running), from ``/proc/stat``; and the HTTP side's server CPU per request: the
server's processes (its process group: the master and its workers, from
``/proc/PID/stat``) over every request the agents sent in the phase. Each HTTP agent
is an ``AgentClient`` (signing every request). Then, per server, ``--wake-samples``
commit -> ``wait`` answers of one parked agent (and the same for an agent parked in
a claim with ``wait``, commit -> lease in hand), and (uvicorn) the HTTP side again
while ``--waiters`` other agents sit in ``wait``, against the HTTP side alone just
before.

``--capacity N[,N...]`` measures only the waiting capacity of one uvicorn worker: N
agents parked in ``POST v1/claim`` with ``wait`` (a second process, raw HTTP/1.1 over
asyncio streams, one keep-alive connection each), the ramp until all are parked, the
server's memory per waiter and its CPU while they wait, commit -> lease for
``--capacity-sends`` sends to single waiting agents, and the 503s:

    .venv/bin/python bench/api.py --capacity 1000,5000,10000 --capacity-rate 150 \
        --capacity-env ASGI_THREADS=8 --capacity-env WORKFLOW_DELIVERY_API_IN_FLIGHT_WAIT_SECONDS=30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

HOST = "127.0.0.1"
LEASE_SECONDS = 60
BODY = b'{"lease_seconds":60}'

SEED = """
INSERT INTO workflow_agent_deliveries (
    id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
    message_event_id, message_event_created_at, cause_kind, cause_event_id, created_at)
SELECT gen_random_uuid(), %(community)s, %(workflow)s, %(run)s, 'api-' || g,
       (%(targets)s::bytea[])[g %% %(agents)s + 1], %(definition)s, %(message)s,
       %(message_at)s, 'event', %(cause)s, now() - interval '1 hour' + g * interval '1 microsecond'
  FROM generate_series(1, %(rows)s) AS g
"""


def _seed(db: common.BenchDb, tenant: common.Tenant, keys: list[bytes], rows: int) -> None:
    with db.connect() as conn:
        common.truncate_deliveries(conn)
        conn.execute(
            SEED,
            {
                "community": tenant.community_id,
                "workflow": tenant.workflow_id,
                "run": tenant.run_id,
                "targets": keys,
                "agents": len(keys),
                "definition": tenant.definition_id,
                "message": tenant.message_id,
                "message_at": tenant.message_created_at,
                "cause": tenant.cause_id,
                "rows": rows,
            },
        )
        common.vacuum(conn)


def _agent(
    mode: str, index: int, secret: bytes, where: str, community: str, batch: int, barrier, stop, out
):
    """One agent process: claim + finish until ``stop``, stamping each cycle's end
    with the deliveries it settled (``http-batch``: up to ``batch`` per request), and
    counting the requests it sent (none in process)."""
    requests = [0]

    def sent(answer):
        requests[0] += 1
        return answer

    if mode == "service":
        common.setup_django(where)
        from django.db import connections

        from workflow_delivery import services
        from workflow_delivery.keys import public_key_bytes as public_key

        target = public_key(secret)

        def claim():
            return services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)

        def finish(claimed):
            return services.finish_delivery(claimed[0], "finished")

        close = connections.close_all
    elif mode == "http-batch":
        from workflow_delivery.client import AgentClient

        client = AgentClient(f"{where}/agents/", secret)

        def claim():
            return sent(client.claim_many(batch, lease_seconds=LEASE_SECONDS)) or None

        def finish(claimed):
            return sent(client.finish_many([(lease, "finished") for lease, _ in claimed]))

        close = client.close
    elif mode == "http-next":
        from workflow_delivery.client import AgentClient

        client = AgentClient(f"{where}/agents/", secret)
        # The busy agent: each finish claims the next delivery in the same request, so
        # a plain claim is sent only when nothing is held (the start, after a miss).
        held: list = [None]

        def claim():
            return held[0] or sent(client.claim(lease_seconds=LEASE_SECONDS))

        def finish(claimed):
            answer = sent(
                client.finish_and_claim_next(claimed[0], "finished", lease_seconds=LEASE_SECONDS)
            )
            held[0] = answer.next
            return answer.result

        close = client.close
    else:
        from workflow_delivery.client import AgentClient

        client = AgentClient(f"{where}/agents/", secret)

        def claim():
            return sent(client.claim(lease_seconds=LEASE_SECONDS))

        def finish(claimed):
            return sent(client.finish(claimed[0], "finished"))

        close = client.close
    stamps: list[tuple[float, float, int]] = []
    misses = 0
    cpu = float("nan")
    try:
        barrier.wait(120)
        cpu_started = time.process_time()
        while not stop.is_set():
            started = time.monotonic()
            claimed = claim()
            if claimed is None:
                misses += 1
                continue
            finish(claimed)
            settled = len(claimed) if mode == "http-batch" else 1
            stamps.append((time.monotonic(), time.monotonic() - started, settled))
        cpu = time.process_time() - cpu_started
    finally:
        close()
        out.put((index, stamps, misses, cpu, requests[0]))


def _phase(
    mode: str,
    where: str,
    community: str,
    secrets: list[bytes],
    options,
    label: str = "",
    server: int | None = None,
) -> dict:
    """One side's run; ``server``: the HTTP server's process group, whose CPU per
    request (every request of the phase, warm-up included) is reported too."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(len(secrets) + 1)
    stop = context.Event()
    out = context.Queue()
    arguments = (where, community, options.batch, barrier, stop, out)
    workers = [
        context.Process(target=_agent, args=(mode, i, key, *arguments), daemon=True)
        for i, key in enumerate(secrets)
    ]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(120)
        started, busy_started = time.monotonic(), _machine_busy_seconds()
        server_started = _group_cpu_seconds(server) if server is not None else float("nan")
        begin = started + options.warmup
        end = begin + options.seconds
        time.sleep(end - time.monotonic())
    finally:
        stop.set()
    busy = _machine_busy_seconds() - busy_started
    elapsed = time.monotonic() - started
    results = [out.get(timeout=60) for _ in workers]
    # After the agents' last answers: their requests' work on the server is done.
    server_cpu = _group_cpu_seconds(server) - server_started if server is not None else float("nan")
    for worker in workers:
        worker.join(30)
    inside = [
        (lat, settled)
        for _, stamps, _, _, _ in results
        for stamp, lat, settled in stamps
        if begin <= stamp < end
    ]
    misses = sum(miss for _, _, miss, _, _ in results)
    # Every cycle of the phase, warm-up included, against the CPU it cost: the agents'
    # own (their processes) and the machine's whole (the server, PostgreSQL and all).
    cycles = sum(len(stamps) for _, stamps, _, _, _ in results) or float("nan")
    agents_cpu = sum(cpu for _, _, _, cpu, _ in results)
    requests = sum(sent for *_, sent in results) or float("nan")
    settled = sum(count for _, count in inside)
    inside = [lat for lat, _ in inside]
    return {
        "mode": label or mode,
        "cycles": len(inside),
        "cycles_per_s": len(inside) / options.seconds,
        "deliveries_per_s": settled / options.seconds,
        "p50_ms": common.percentile(inside, 50) * 1000,
        "p99_ms": common.percentile(inside, 99) * 1000,
        "misses": misses,
        "agent_cpu_us_per_cycle": agents_cpu / cycles * 1e6,
        "other_cpu_us_per_cycle": (busy - agents_cpu) / cycles * 1e6,
        "busy_cores": busy / elapsed,
        "requests": requests,
        "server_cpu_ms_per_request": server_cpu / requests * 1000,
    }


def _group_cpu_seconds(group: int) -> float:
    """CPU seconds (user and system) the live processes of process group ``group`` have
    used so far: a server started in a session of its own, its workers included."""
    seconds = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            process_group, cpu = common.process_cpu(int(entry))
        except OSError:
            continue
        if process_group == group:
            seconds += cpu
    return seconds


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``: every
    state but idle and iowait), or NaN where there is no such file."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return float("nan")
    ticks = [int(field) for field in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _waiters(url: str, secrets: list[bytes], stop: threading.Event) -> list[threading.Thread]:
    """Agents (enrolled keys with no deliveries) waiting in ``wait`` in a loop."""
    from workflow_delivery.client import AgentClient

    def wait_forever(secret: bytes) -> None:
        with AgentClient(f"{url}/agents/", secret, timeout=30) as client:
            while not stop.is_set():
                client.wait(timeout=5)

    threads = [
        threading.Thread(target=wait_forever, args=(secret,), daemon=True) for secret in secrets
    ]
    for thread in threads:
        thread.start()
    return threads


def _per_call(function, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        function()
    return (time.perf_counter() - started) / count * 1e6


def _auth_costs(secret: bytes, count: int) -> dict[str, float]:
    """Microseconds per request of each part of authentication, in this process."""
    from django.db import connection

    from workflow_delivery import services
    from workflow_delivery.api import nip98
    from workflow_delivery.keys import SigningKey

    url = f"http://{HOST}/agents/v1/claim"
    # As the client signs: its key pair derived once.
    signer = SigningKey(secret)
    headers = iter([nip98.sign_request(secret, url=url, method="POST", body=BODY)] * count)

    def verify() -> None:
        event = nip98.parse_authorization(next(headers))
        nip98.check_request(event, url=url, method="POST", body=BODY)
        nip98.verify_event(event)

    first = services.admit_request_event(
        HOST, os.urandom(32), int(time.time()), pubkey=signer.pubkey
    )
    if not first.recorded:
        raise RuntimeError(f"the bench's agent is not admitted at {HOST}: {first}")

    def admit() -> None:
        # What every request's admission does: host, roster standing, replay insert.
        services.admit_request_event(HOST, os.urandom(32), int(time.time()), pubkey=signer.pubkey)

    def round_trip() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    return {
        "sign_us": _per_call(lambda: signer.sign_request(url=url, method="POST", body=BODY), count),
        "verify_us": _per_call(verify, count),
        "admission_us": _per_call(admit, count),
        "select_1_round_trip_us": _per_call(round_trip, count),
    }


def _commit_one(tenant: common.Tenant, target: bytes) -> None:
    import uuid

    from workflow_delivery import services
    from workflow_delivery.protocol import DeliveryBinding, EventCause, NewDelivery

    binding = DeliveryBinding(
        community_id=tenant.community_id,
        workflow_id=tenant.workflow_id,
        run_id=tenant.run_id,
        step_id=f"wake-{uuid.uuid4().hex}",
        target_pubkey=target,
        definition_event_id=tenant.definition_id,
        message_event_id=tenant.message_id,
        cause=EventCause(tenant.cause_id),
    )
    delivery = NewDelivery(uuid.uuid4(), binding)
    services.commit_deliveries(tenant.community_id, tenant.message_created_at, [delivery])


def _wake_phase(url: str, tenant: common.Tenant, samples: int, *, claim: bool = False) -> dict:
    """Commit -> answer of one agent parked in ``wait``: the clock starts before the
    producer's ``commit_deliveries`` is called (so it includes the commit) and stops
    when the agent's ``wait`` returns the delivery. The agent claims and finishes
    what it was woken for before it waits again; a commit is made only once its
    target is registered idle and 20 ms more have passed, so each is announced by
    the commit's own notification, not found by the wait's first look. The commit's
    own time (its WAL flush) and the rest (notification, server, answer) are reported
    apart as well. With ``claim`` the agent waits in ``POST v1/claim`` with ``wait``
    instead: the clock stops when the lease is in its hand (commit -> lease)."""
    import queue

    from workflow_delivery import services
    from workflow_delivery.client import AgentClient
    from workflow_delivery.keys import public_key_bytes as public_key
    from workflow_delivery.models import IdleWakeTarget

    secret = os.urandom(32)
    target = public_key(secret)
    services.enroll_agent(tenant.community_id, target)
    answers: queue.Queue = queue.Queue()
    stop = threading.Event()

    def agent() -> None:
        with AgentClient(f"{url}/agents/", secret, timeout=30) as client:
            while not stop.is_set():
                if claim:
                    claimed = client.claim(wait=10, lease_seconds=LEASE_SECONDS)
                    answers.put((time.monotonic(), claimed))
                    if claimed is not None:
                        client.finish(claimed.lease, "finished")
                    continue
                hint = client.wait(timeout=10)
                answers.put((time.monotonic(), hint))
                if hint is not None:
                    lease, _record = client.claim(delivery_id=hint.delivery_id)
                    client.finish(lease, "finished")

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    idle = IdleWakeTarget.objects.filter(community_id=tenant.community_id, target_pubkey=target)
    latencies: list[float] = []
    commits: list[float] = []
    after_commit: list[float] = []
    try:
        for _ in range(samples):
            deadline = time.monotonic() + 15
            while not idle.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the waiting agent never registered as idle")
                time.sleep(0.002)
            time.sleep(0.02)
            started = time.monotonic()
            _commit_one(tenant, target)
            committed = time.monotonic()
            while True:
                answered, hint = answers.get(timeout=15)
                if hint is not None:
                    break
            latencies.append(answered - started)
            commits.append(committed - started)
            after_commit.append(answered - committed)
    finally:
        stop.set()
        thread.join(15)
    return {
        "samples": len(latencies),
        "p50_ms": common.percentile(latencies, 50) * 1000,
        "p99_ms": common.percentile(latencies, 99) * 1000,
        "max_ms": max(latencies) * 1000,
        "commit_p50_ms": common.percentile(commits, 50) * 1000,
        "commit_p99_ms": common.percentile(commits, 99) * 1000,
        "after_commit_p50_ms": common.percentile(after_commit, 50) * 1000,
        "after_commit_p99_ms": common.percentile(after_commit, 99) * 1000,
    }


# The waiting capacity of one server process (``--capacity``): a crowd of agents, each
# parked in a waiting claim on a keep-alive connection of its own, sent by a second
# process (``_crowd``) over raw HTTP/1.1 on asyncio streams, so ten thousand of them
# cost the generator little and none of the server's CPU accounting.

CAPACITY_WAIT = 60
CAPACITY_BODY = json.dumps({"wait": CAPACITY_WAIT, "lease_seconds": LEASE_SECONDS}).encode()


def raise_open_files_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` raised to its hard limit; the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


async def _read_answer(reader) -> tuple[int, bytes]:
    """One HTTP/1.1 answer's status and body (the server always sends a length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return status, body


def _crowd(
    url: str, secrets: list[bytes], connects: int, rate: float, held, stop, answers, summary
) -> None:
    """The crowd's process: one connection per secret, the first claims sent at
    ``rate`` a second, each sending a waiting claim again as soon as the last is
    answered, until ``stop``. A 200 (a lease) is put on ``answers`` as (index,
    monotonic time) at once; the counts of every status (during the ramp, and once
    ``held`` is set), the failures and the open-files limit go to ``summary`` at the
    end."""
    import asyncio
    from collections import Counter
    from urllib.parse import urlsplit

    from workflow_delivery.keys import SigningKey

    limit = raise_open_files_limit()
    parts = urlsplit(url)
    claim_url = f"{url}/agents/v1/claim"
    head = (
        f"POST /agents/v1/claim HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(CAPACITY_BODY)}\r\n"
    ).encode()
    keys = [SigningKey(secret) for secret in secrets]
    statuses: Counter = Counter()
    held_statuses: Counter = Counter()
    failures: Counter = Counter()

    async def park(index: int, gate: asyncio.Semaphore) -> None:
        key = keys[index]
        await asyncio.sleep(index / rate)
        async with gate:
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            while not stop.is_set():
                authorization = key.sign_request(url=claim_url, method="POST", body=CAPACITY_BODY)
                writer.write(head + f"Authorization: {authorization}\r\n\r\n".encode())
                writer.write(CAPACITY_BODY)
                status, _ = await _read_answer(reader)
                (held_statuses if held.is_set() else statuses)[status] += 1
                if status == 200:
                    answers.put((index, time.monotonic()))
                elif status != 204:
                    # A refusal (503 too_many_waiters and the like): back off as told.
                    await asyncio.sleep(1.0)
        finally:
            writer.close()

    async def run() -> None:
        gate = asyncio.Semaphore(connects)
        tasks = [asyncio.create_task(park(index, gate)) for index in range(len(keys))]
        while not stop.is_set():
            await asyncio.sleep(0.2)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    failures[repr(task.exception())[:80]] += 1
            tasks = [task for task in tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    summary.put(
        {
            "statuses": dict(statuses),
            "held_statuses": dict(held_statuses),
            "failures": dict(failures),
            "nofile": limit,
        }
    )


def _process_figures(pid: int) -> tuple[float, float]:
    """A process's resident memory (MiB, ``VmRSS``) and CPU seconds so far."""
    with open(f"/proc/{pid}/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kib / 1024, common.process_cpu(pid)[1]


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _capacity_phase(db, tenant: common.Tenant, waiters: int, options) -> dict:
    """``waiters`` agents parked in ``POST v1/claim`` with ``wait`` on one uvicorn
    worker: the ramp until every one is registered idle (parked), the server's memory
    and CPU while they wait, then ``--capacity-sends`` commits to one waiting agent at
    a time, each measured from before the commit to the lease in the agent's hand."""
    import multiprocessing
    import queue
    import random

    from workflow_delivery.keys import public_key_bytes as public_key
    from workflow_delivery.models import IdleWakeTarget

    secrets = [os.urandom(32) for _ in range(waiters)]
    keys = [public_key(secret) for secret in secrets]
    probe_secret = os.urandom(32)
    probe_key = public_key(probe_secret)
    with db.connect() as conn:
        common.enroll(conn, tenant.community_id, [*keys, probe_key])
        conn.execute("DELETE FROM workflow_agent_deliveries")
        # A level before this one left its agents registered idle: parked counts anew.
        conn.execute("DELETE FROM workflow_delivery_idle_wake_targets")
    spawn = multiprocessing.get_context("spawn")
    stop, held, answers, summary = spawn.Event(), spawn.Event(), spawn.Queue(), spawn.Queue()
    started: list = []
    env = {"WORKFLOW_DELIVERY_API_MAX_WAITERS": str(options.capacity_cap or waiters + 100)}
    env |= dict(item.split("=", 1) for item in options.capacity_env)
    with common.api_server(
        common.database_url(db), server="uvicorn", workers=1, env=env, started=started
    ) as url:
        pid = started[0].pid
        # Warm: the listener and a thread's connection opened by one short wait.
        from workflow_delivery.client import AgentClient

        with AgentClient(f"{url}/agents/", probe_secret, timeout=10) as probe:
            probe.claim(wait=1)
        time.sleep(0.5)
        rss_before, cpu_before = _process_figures(pid)
        idle = IdleWakeTarget.objects.filter(community_id=tenant.community_id).exclude(
            target_pubkey=probe_key
        )
        crowd = spawn.Process(
            target=_crowd,
            args=(
                url,
                secrets,
                options.capacity_connects,
                options.capacity_rate,
                held,
                stop,
                answers,
                summary,
            ),
            daemon=True,
        )
        ramp_started = time.monotonic()
        crowd.start()
        parked = 0
        try:
            deadline = ramp_started + options.capacity_ramp
            while (parked := idle.count()) < waiters and time.monotonic() < deadline:
                if not crowd.is_alive():
                    raise RuntimeError(f"the crowd's process ended ({crowd.exitcode})")
                time.sleep(0.5)
            ramp = time.monotonic() - ramp_started
            print(f"  capacity {waiters}: {parked} parked after {ramp:.1f} s", flush=True)
            held.set()
            _, cpu_start = _process_figures(pid)
            ramp_cpu_ms = (cpu_start - cpu_before) * 1000 / max(parked, 1)
            hold_started = time.monotonic()
            time.sleep(options.capacity_hold)
            rss_held, cpu_held = _process_figures(pid)
            held_cpu = (cpu_held - cpu_start) / (time.monotonic() - hold_started)
            fds = _open_files(pid)
            latencies: list[float] = []
            commits: list[float] = []
            missed = 0
            chosen = random.sample(range(waiters), min(options.capacity_sends, waiters))
            for index in chosen:
                target = keys[index]
                registered = idle.filter(target_pubkey=target)
                deadline = time.monotonic() + 10
                while not registered.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                # Leases of earlier sends answered late are not this one's.
                while True:
                    try:
                        answers.get_nowait()
                    except queue.Empty:
                        break
                began = time.monotonic()
                _commit_one(tenant, target)
                commits.append(time.monotonic() - began)
                try:
                    while True:
                        answered_index, answered = answers.get(timeout=10)
                        if answered_index == index:
                            latencies.append(answered - began)
                            break
                except queue.Empty:
                    missed += 1
                time.sleep(0.01)
            rss_after, _ = _process_figures(pid)
        finally:
            stop.set()
            crowd.join(30)
            if crowd.is_alive():
                crowd.terminate()
    counts = summary.get(timeout=5) if not summary.empty() else {}
    statuses = counts.get("statuses", {})
    held_statuses = counts.get("held_statuses", {})
    return {
        "waiters": waiters,
        "parked": parked,
        "ramp_s": ramp,
        "ramp_server_cpu_ms_per_waiter": ramp_cpu_ms,
        "rss_before_mib": rss_before,
        "rss_held_mib": rss_held,
        "rss_after_mib": rss_after,
        "kib_per_waiter": (rss_held - rss_before) * 1024 / max(parked, 1),
        "server_cpu_while_held": held_cpu,
        "server_fds": fds,
        "sends": len(chosen),
        "answered": len(latencies),
        "missed": missed,
        "p50_ms": common.percentile(latencies, 50) * 1000 if latencies else float("nan"),
        "p99_ms": common.percentile(latencies, 99) * 1000 if latencies else float("nan"),
        "max_ms": max(latencies) * 1000 if latencies else float("nan"),
        # The producer's commit alone (its WAL flush), inside each latency above.
        "commit_p50_ms": common.percentile(commits, 50) * 1000 if commits else float("nan"),
        "commit_p99_ms": common.percentile(commits, 99) * 1000 if commits else float("nan"),
        "ramp_statuses": statuses,
        "held_statuses": held_statuses,
        "ramp_503": statuses.get(503, 0),
        "held_503": held_statuses.get(503, 0),
        "failures": counts.get("failures", {}),
        "client_nofile": counts.get("nofile"),
    }


def _capacity_line(figures: dict) -> str:
    return (
        f"| {figures['waiters']} | {figures['parked']} | {figures['ramp_s']:.1f} "
        f"| {figures['ramp_server_cpu_ms_per_waiter']:.2f} "
        f"| {figures['rss_before_mib']:.0f} | {figures['rss_held_mib']:.0f} "
        f"| {figures['kib_per_waiter']:.1f} | {figures['server_cpu_while_held']:.2f} "
        f"| {figures['answered']}/{figures['sends']} | {figures['p50_ms']:.1f} "
        f"| {figures['p99_ms']:.1f} | {figures['max_ms']:.1f} "
        f"| {figures['commit_p50_ms']:.1f} / {figures['commit_p99_ms']:.1f} "
        f"| {figures['ramp_503']} / {figures['held_503']} "
        f"| {sum(figures['failures'].values())} |"
    )


def _capacity(options) -> int:
    """``--capacity``: each level in turn on a fresh server, and their table."""
    results = []
    with common.bench_database(options.db_prefix, quiet=True) as db:
        with db.connect() as conn:
            tenant = common.create_tenant(conn, "api")
            rename = "UPDATE communities SET host = %s WHERE id = %s"
            conn.execute(rename, [HOST, tenant.community_id])
        for waiters in options.capacity:
            results.append(_capacity_phase(db, tenant, waiters, options))
            print(f"  {results[-1]}", flush=True)
    print()
    print(
        "| waiters | parked | ramp s | server CPU ms per parked waiter "
        "| RSS before MiB | RSS held MiB | KiB/waiter "
        "| server CPU while held (cores) | sends answered | p50 ms | p99 ms | max ms "
        "| the commit alone p50 / p99 ms "
        "| 503s ramp / held | client failures |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for figures in results:
        print(_capacity_line(figures))
    if options.json is not None:
        options.json.write_text(json.dumps({"capacity": results}, indent=2))
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per side")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured start per side")
    parser.add_argument("--agents", type=int, default=8, help="agent processes per side")
    parser.add_argument(
        "--server",
        choices=(*common.SERVERS, "both"),
        default="both",
        help="the HTTP side's server (both: each in turn)",
    )
    parser.add_argument("--server-workers", type=int, default=2, help="server worker processes")
    parser.add_argument(
        "--runs", type=int, default=3, help="rounds of in-process then HTTP (0: none)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=10,
        metavar="N",
        help="claim/finish N per request in a batch line (0: no batch line)",
    )
    parser.add_argument(
        "--wake-samples",
        type=int,
        default=50,
        metavar="N",
        help="commit -> wait answer samples per server (0: none)",
    )
    parser.add_argument(
        "--pool",
        type=int,
        default=0,
        metavar="N",
        help="serve with Django's connection pool of N sessions per worker (0: none)",
    )
    parser.add_argument("--rows", type=int, default=100_000, help="pending deliveries seeded")
    parser.add_argument(
        "--waiters", type=int, default=100, help="agents in wait during a last phase (uvicorn)"
    )
    parser.add_argument("--auth-calls", type=int, default=2000, help="calls per auth figure")
    parser.add_argument("--db-prefix", default="buzz_bench", help="prefix of the scratch database")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument(
        "--capacity",
        type=lambda text: [int(part) for part in text.split(",")],
        default=None,
        metavar="N[,N...]",
        help="measure only the waiting capacity: N agents parked in a waiting claim",
    )
    parser.add_argument("--capacity-sends", type=int, default=200, metavar="M")
    parser.add_argument("--capacity-hold", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument("--capacity-ramp", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument("--capacity-connects", type=int, default=256, metavar="N")
    parser.add_argument(
        "--capacity-rate", type=float, default=1000.0, help="first claims sent a second"
    )
    parser.add_argument(
        "--capacity-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the server's environment (e.g. ASGI_THREADS=8)",
    )
    parser.add_argument(
        "--capacity-cap", type=int, default=0, help="the server's API_MAX_WAITERS (0: N + 100)"
    )
    options = parser.parse_args(argv)
    if options.agents < 1 or options.server_workers < 1 or options.rows < 1:
        parser.error("--agents, --server-workers and --rows must be positive")
    if min(options.pool, options.batch, options.wake_samples, options.runs) < 0:
        parser.error("--pool, --batch, --wake-samples and --runs must be 0 or more")
    return options


def _row(side: dict) -> str:
    return (
        f"| {side['mode']} | {side['cycles_per_s']:.0f} | {side['deliveries_per_s']:.0f} "
        f"| {side['p50_ms']:.2f} | {side['p99_ms']:.2f} | {side['misses']} "
        f"| {side['agent_cpu_us_per_cycle']:.0f} | {side['other_cpu_us_per_cycle']:.0f} "
        f"| {side['busy_cores']:.2f} | {side['server_cpu_ms_per_request']:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    options = _arguments(argv)
    if options.capacity:
        return _capacity(options)
    servers = list(common.SERVERS) if options.server == "both" else [options.server]
    secrets = [os.urandom(32) for _ in range(options.agents)]
    waiter_secrets = [os.urandom(32) for _ in range(options.waiters)]
    with common.bench_database(options.db_prefix, quiet=True) as db, ExitStack() as stack:
        from workflow_delivery.keys import public_key_bytes as public_key

        keys = [public_key(secret) for secret in secrets]
        with db.connect() as conn:
            tenant = common.create_tenant(conn, "api")
            waiter_keys = [public_key(secret) for secret in waiter_secrets]
            common.enroll(conn, tenant.community_id, keys + waiter_keys)
            rename = "UPDATE communities SET host = %s WHERE id = %s"
            conn.execute(rename, [HOST, tenant.community_id])
        community = str(tenant.community_id)
        print(
            f"api bench: {options.agents} agents, {options.seconds:g} s per side,"
            f" {options.runs} runs, servers {', '.join(servers)}",
            flush=True,
        )
        pool = {"DATABASE_POOL_SIZE": str(options.pool)} if options.pool else None
        processes: dict[str, list] = {server: [] for server in servers}
        urls = {
            server: stack.enter_context(
                common.api_server(
                    common.database_url(db),
                    server=server,
                    workers=options.server_workers,
                    env=pool,
                    started=processes[server],
                )
            )
            for server in servers
        }
        # Each server runs in a session of its own: its process group is its pid.
        groups = {server: started[0].pid for server, started in processes.items()}
        # Each HTTP phase right after an in-process phase of its own, from the same
        # seed: on a busy machine the pair sees the same load.
        runs: list[dict] = []
        for run in range(1, options.runs + 1):
            rounds: dict[str, dict] = {}
            for server in servers:
                lines = [("http", server), ("http-next", f"{server} finish with next")]
                if options.batch:
                    lines.append(("http-batch", f"{server} batch of {options.batch}"))
                for mode, label in lines:
                    _seed(db, tenant, keys, options.rows)
                    service = _phase("service", db.name, community, secrets, options)
                    _seed(db, tenant, keys, options.rows)
                    http = _phase(
                        mode, urls[server], community, secrets, options, label, groups[server]
                    )
                    ratio = http["deliveries_per_s"] / (service["cycles_per_s"] or float("nan"))
                    rounds[label] = {"service": service, "http": http, "ratio": ratio}
                    print(
                        f"  run {run}, {label}: {http['deliveries_per_s']:.0f} deliveries/s"
                        f" / in-process {service['cycles_per_s']:.0f} = {ratio:.3f};"
                        f" server CPU {http['server_cpu_ms_per_request']:.2f} ms a request",
                        flush=True,
                    )
            runs.append(rounds)

        wakes = {}
        if options.wake_samples:
            for server in servers:
                for label, waiting_claim in ((server, False), (f"{server} claim", True)):
                    wakes[label] = _wake_phase(
                        urls[server], tenant, options.wake_samples, claim=waiting_claim
                    )
                    print(
                        f"  {'claim' if waiting_claim else 'wait'} woken ({server}): commit ->"
                        f" answer p50 {wakes[label]['p50_ms']:.2f} ms,"
                        f" p99 {wakes[label]['p99_ms']:.2f} ms",
                        flush=True,
                    )

        waiting = crowd_ratio = None
        if options.waiters and "uvicorn" in urls:
            _seed(db, tenant, keys, options.rows)
            alone = _phase(
                "http", urls["uvicorn"], community, secrets, options, server=groups["uvicorn"]
            )
            _seed(db, tenant, keys, options.rows)
            stop = threading.Event()
            crowd = _waiters(urls["uvicorn"], waiter_secrets, stop)
            time.sleep(2.0)
            try:
                waiting = _phase(
                    "http",
                    urls["uvicorn"],
                    community,
                    secrets,
                    options,
                    "uvicorn+waiters",
                    groups["uvicorn"],
                )
            finally:
                stop.set()
                for thread in crowd:
                    thread.join(10)
            if alone["cycles_per_s"]:
                crowd_ratio = waiting["cycles_per_s"] / alone["cycles_per_s"]
        costs = _auth_costs(secrets[0], options.auth_calls)

    print()
    print(
        "| run | side | cycles/s | deliveries/s | p50 cycle ms | p99 cycle ms | misses "
        "| agents' CPU µs/cycle | rest of the machine µs/cycle | busy cores "
        "| server CPU ms/request |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run, rounds in enumerate(runs, 1):
        for round_ in rounds.values():
            for side in (round_["service"], round_["http"]):
                print(f"| {run} " + _row(side))
    print()
    print("| HTTP side | " + " | ".join(f"run {run}" for run in range(1, len(runs) + 1)) + " |")
    print("|---|" + "---|" * len(runs))
    for label in runs[0] if runs else ():
        ratios = " | ".join(f"{rounds[label]['ratio']:.3f}" for rounds in runs)
        print(f"| {label} / in-process | {ratios} |")
    for server, wake in wakes.items():
        print(
            f"\nwait woken ({server}), commit -> answer over {wake['samples']} samples:"
            f" p50 {wake['p50_ms']:.2f} ms, p99 {wake['p99_ms']:.2f} ms,"
            f" max {wake['max_ms']:.2f} ms; the commit itself p50 {wake['commit_p50_ms']:.2f},"
            f" p99 {wake['commit_p99_ms']:.2f} ms; its end -> answer p50"
            f" {wake['after_commit_p50_ms']:.2f}, p99 {wake['after_commit_p99_ms']:.2f} ms"
        )
    if crowd_ratio is not None:
        print(f"uvicorn with {options.waiters} agents waiting / without: {crowd_ratio:.3f}x")
    print(
        f"per request: sign {costs['sign_us']:.0f} µs (client), verify {costs['verify_us']:.0f} µs,"
        f" admission (host, roster, replay insert) {costs['admission_us']:.0f} µs"
        f" (SELECT 1 round trip {costs['select_1_round_trip_us']:.0f} µs)"
    )
    if options.json is not None:
        report = {"runs": runs, "wake": wakes, "auth": costs}
        report |= {"http_with_waiters": waiting, "waiters_ratio": crowd_ratio}
        report["options"] = {k: str(v) for k, v in vars(options).items()}
        options.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
