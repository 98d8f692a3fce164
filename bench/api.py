"""The agent HTTP API: claim+finish cycles/s over HTTP against the in-process service,
and the per-request cost of NIP-98 verification and the replay-guard insert.

    .venv/bin/python bench/api.py                          # 8 agents, 2 uvicorn workers
    .venv/bin/python bench/api.py --server gunicorn        # WSGI, persistent connections
    .venv/bin/python bench/api.py --seconds 1 --rows 500 --agents 2 --server-workers 1

Creates its own database (``<prefix>_<pid>``), migrates, seeds pending deliveries
round-robin over the agents' keys, and drops it at the end (also on Ctrl-C/SIGTERM).
A third phase (uvicorn only) repeats the HTTP side while ``--waiters`` other agents
sit in ``wait``, to show that waiting agents do not slow claims. Each side runs
``--agents`` processes that start together on a barrier; only cycles
that end inside the measured window count. The HTTP side is the demo project under
uvicorn with ``--server-workers`` worker processes on loopback, each agent an
``AgentClient`` (signing every request); the service side calls
``workflow_delivery.services`` directly. Both sides start from the same seed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
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


def _agent(mode: str, index: int, secret: bytes, where: str, community: str, barrier, stop, out):
    """One agent process: claim + finish until ``stop``, stamping each cycle's end."""
    if mode == "service":
        common.setup_django(where)
        from django.db import connections

        from workflow_delivery import services
        from workflow_delivery.keys import public_key_bytes as public_key

        target = public_key(secret)

        def claim():
            return services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)

        def finish(lease):
            return services.finish_delivery(lease, "finished")

        close = connections.close_all
    else:
        from workflow_delivery.client import AgentClient

        client = AgentClient(f"{where}/agents/", secret)

        def claim():
            return client.claim(lease_seconds=LEASE_SECONDS)

        def finish(lease):
            return client.finish(lease, "finished")

        close = client.close
    stamps: list[tuple[float, float]] = []
    misses = 0
    try:
        barrier.wait(120)
        while not stop.is_set():
            started = time.monotonic()
            claimed = claim()
            if claimed is None:
                misses += 1
                continue
            finish(claimed[0])
            stamps.append((time.monotonic(), time.monotonic() - started))
    finally:
        close()
        out.put((index, stamps, misses))


def _phase(mode: str, where: str, community: str, secrets: list[bytes], options) -> dict:
    context = mp.get_context("spawn")
    barrier = context.Barrier(len(secrets) + 1)
    stop = context.Event()
    out = context.Queue()
    workers = [
        context.Process(
            target=_agent, args=(mode, i, key, where, community, barrier, stop, out), daemon=True
        )
        for i, key in enumerate(secrets)
    ]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(120)
        begin = time.monotonic() + options.warmup
        end = begin + options.seconds
        time.sleep(end - time.monotonic())
    finally:
        stop.set()
    results = [out.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
    inside = [lat for _, stamps, _ in results for stamp, lat in stamps if begin <= stamp < end]
    misses = sum(miss for _, _, miss in results)
    return {
        "mode": mode,
        "cycles": len(inside),
        "cycles_per_s": len(inside) / options.seconds,
        "p50_ms": common.percentile(inside, 50) * 1000,
        "p99_ms": common.percentile(inside, 99) * 1000,
        "misses": misses,
    }


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


def _auth_costs(community: str, secret: bytes, count: int) -> dict[str, float]:
    """Microseconds per request of each part of authentication, in this process."""
    from django.db import connection

    from workflow_delivery import services
    from workflow_delivery.api import nip98

    url = f"http://{HOST}/agents/v1/claim"
    headers = iter([nip98.sign_request(secret, url=url, method="POST", body=BODY)] * count)

    def verify() -> None:
        event = nip98.parse_authorization(next(headers))
        nip98.check_request(event, url=url, method="POST", body=BODY)
        nip98.verify_event(event)

    def record() -> None:
        services.record_request_event(community, os.urandom(32), int(time.time()))

    def round_trip() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    return {
        "sign_us": _per_call(
            lambda: nip98.sign_request(secret, url=url, method="POST", body=BODY), count
        ),
        "verify_us": _per_call(verify, count),
        "replay_insert_us": _per_call(record, count),
        "select_1_round_trip_us": _per_call(round_trip, count),
    }


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per side")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured start per side")
    parser.add_argument("--agents", type=int, default=8, help="agent processes per side")
    parser.add_argument("--server", choices=common.SERVERS, default="uvicorn")
    parser.add_argument("--server-workers", type=int, default=2, help="server worker processes")
    parser.add_argument(
        "--pool",
        type=int,
        default=0,
        metavar="N",
        help="serve with Django's connection pool of N sessions per worker (0: none)",
    )
    parser.add_argument("--rows", type=int, default=100_000, help="pending deliveries seeded")
    parser.add_argument(
        "--waiters", type=int, default=100, help="agents in wait during a third phase (uvicorn)"
    )
    parser.add_argument("--auth-calls", type=int, default=2000, help="calls per auth figure")
    parser.add_argument("--db-prefix", default="buzz_bench", help="prefix of the scratch database")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    options = parser.parse_args(argv)
    if options.agents < 1 or options.server_workers < 1 or options.rows < 1:
        parser.error("--agents, --server-workers and --rows must be positive")
    if options.pool < 0:
        parser.error("--pool must be 0 or more")
    return options


def main(argv: list[str] | None = None) -> int:
    options = _arguments(argv)
    secrets = [os.urandom(32) for _ in range(options.agents)]
    waiter_secrets = [os.urandom(32) for _ in range(options.waiters)]
    with common.bench_database(options.db_prefix, quiet=True) as db:
        from workflow_delivery.keys import public_key_bytes as public_key

        keys = [public_key(secret) for secret in secrets]
        with db.connect() as conn:
            tenant = common.create_tenant(conn, "api")
            waiter_keys = [public_key(secret) for secret in waiter_secrets]
            common.enroll(conn, tenant.community_id, keys + waiter_keys)
            rename = "UPDATE communities SET host = %s WHERE id = %s"
            conn.execute(rename, [HOST, tenant.community_id])
        community = str(tenant.community_id)
        print(f"api bench: {options.agents} agents, {options.seconds:g} s per side", flush=True)

        _seed(db, tenant, keys, options.rows)
        service = _phase("service", db.name, community, secrets, options)
        print(f"  in-process service: {service['cycles_per_s']:.0f} cycles/s", flush=True)

        _seed(db, tenant, keys, options.rows)
        pool = {"DATABASE_POOL_SIZE": str(options.pool)} if options.pool else None
        server = common.api_server(
            common.database_url(db),
            server=options.server,
            workers=options.server_workers,
            env=pool,
        )
        with server as url:
            http = _phase("http", url, community, secrets, options)
            waiting = None
            if options.waiters and options.server == "uvicorn":
                _seed(db, tenant, keys, options.rows)
                stop = threading.Event()
                crowd = _waiters(url, waiter_secrets, stop)
                time.sleep(2.0)
                try:
                    waiting = _phase("http+waiters", url, community, secrets, options)
                finally:
                    stop.set()
                    for thread in crowd:
                        thread.join(10)
        print(
            f"  HTTP ({options.server}, {options.server_workers} workers"
            f"{f', pool of {options.pool}' if options.pool else ''}): "
            f"{http['cycles_per_s']:.0f} cycles/s",
            flush=True,
        )
        costs = _auth_costs(community, secrets[0], options.auth_calls)

    ratio = http["cycles_per_s"] / service["cycles_per_s"] if service["cycles_per_s"] else None
    per_request_ms = http["p50_ms"] / 2
    auth_ms = (costs["verify_us"] + costs["replay_insert_us"]) / 1000
    print()
    print("| side | cycles/s | p50 cycle ms | p99 cycle ms | misses |")
    print("|---|---|---|---|---|")
    for side in (service, http, waiting):
        if side is None:
            continue
        print(
            f"| {side['mode']} | {side['cycles_per_s']:.0f} | {side['p50_ms']:.2f} "
            f"| {side['p99_ms']:.2f} | {side['misses']} |"
        )
    print(f"\nHTTP / in-process: {ratio:.3f}x" if ratio is not None else "\nno service cycles")
    crowd_ratio = None
    if waiting is not None and http["cycles_per_s"]:
        crowd_ratio = waiting["cycles_per_s"] / http["cycles_per_s"]
        print(f"HTTP with {options.waiters} agents waiting / without: {crowd_ratio:.3f}x")
    print(
        f"per request: sign {costs['sign_us']:.0f} µs (client), verify {costs['verify_us']:.0f} µs,"
        f" replay insert {costs['replay_insert_us']:.0f} µs"
        f" (SELECT 1 round trip {costs['select_1_round_trip_us']:.0f} µs);"
        f" verify + insert = {auth_ms:.2f} ms of a ~{per_request_ms:.2f} ms request"
    )
    if options.json is not None:
        report = {"service": service, "http": http, "ratio": ratio, "auth": costs}
        report |= {"http_with_waiters": waiting, "waiters_ratio": crowd_ratio}
        report["options"] = {k: str(v) for k, v in vars(options).items()}
        options.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
