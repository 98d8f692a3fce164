"""What one community's deletion costs the others.

* isolation: another community's claim latency (p99, over HTTP, uvicorn with the
  app's ASGI handler) while a community whose deletion lock is held exclusively (as a
  purge batch holds it) takes ``--load`` concurrent requests of its own, against the
  same claims with no deletion under way, in the same run.
* purge: the longest hold of the exclusive deletion lock while a community of
  ``--rows`` deliveries is purged in batches (each batch's transaction, measured
  between two progress calls, so an upper bound), against the same purge in one
  transaction.

Goals: the claim's p99 at most 50 ms; no hold over 1 s for 1,000,000 deliveries.
Run it full on a quiet machine (``--rows 1000000``); small sizes only prove it runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    api_server,
    bench_database,
    create_tenant,
    database_url,
    enroll,
    percentile,
    seed_deliveries,
    setup_django,
)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="deliveries purged")
    parser.add_argument("--claims", type=int, default=500, help="claims timed per phase")
    parser.add_argument("--load", type=int, default=50, help="concurrent requests of the deleted")
    parser.add_argument("--threads", type=int, default=4, help="the ASGI handler's threads")
    parser.add_argument("--batch-size", type=int, default=None, help="the purge's batch size")
    parser.add_argument(
        "--batch-seconds", type=float, default=None, help="the purge's time per batch"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="leave out the same purge in one transaction (it takes as long again)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def _claim(port: int, host: str, secret: bytes) -> tuple[int, float]:
    from workflow_delivery.api import nip98

    url = f"http://{host}:{port}/agents/v1/claim"
    header = nip98.sign_request(secret, url=url, method="POST", body=b"")
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Host": f"{host}:{port}", "Authorization": header}
        conn.request("POST", "/agents/v1/claim", body=b"", headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    finally:
        conn.close()


def _timed_claims(port: int, host: str, secret: bytes, count: int) -> list[float]:
    latencies = []
    for index in range(count):
        status, seconds = _claim(port, host, secret)
        if status not in (200, 204):
            raise RuntimeError(f"another community's claim answered {status}")
        latencies.append(seconds)
        if index % 100 == 99:
            print(f"  {index + 1}/{count} claims", flush=True)
    return latencies


def isolation(db, args: argparse.Namespace) -> dict[str, float]:
    from workflow_delivery.keys import public_key_bytes

    conn = db.connect()
    deleting, other = create_tenant(conn, "deleting"), create_tenant(conn, "other")
    secrets = [os.urandom(32) for _ in range(args.load + 1)]
    enroll(conn, deleting.community_id, [public_key_bytes(s) for s in secrets[1:]])
    enroll(conn, other.community_id, [public_key_bytes(secrets[0])])
    hosts = dict(
        conn.execute(
            "SELECT id, host FROM communities WHERE id = ANY(%s)",
            [[deleting.community_id, other.community_id]],
        ).fetchall()
    )
    env = {"ASGI_THREADS": str(args.threads)}
    with api_server(database_url(db), env=env) as url:
        port = int(url.rsplit(":", 1)[1])
        print("isolation: baseline claims", flush=True)
        baseline = _timed_claims(port, hosts[other.community_id], secrets[0], args.claims)
        executor = db.connect()
        executor.execute("BEGIN")
        executor.execute(
            "SELECT pg_advisory_xact_lock(wd_community_deletion_key(%s))", [deleting.community_id]
        )
        stop = threading.Event()
        refused = [0]

        def load(secret: bytes) -> None:
            while not stop.is_set():
                status, _ = _claim(port, hosts[deleting.community_id], secret)
                refused[0] += status == 503

        workers = [threading.Thread(target=load, args=(s,), daemon=True) for s in secrets[1:]]
        for worker in workers:
            worker.start()
        try:
            print(f"isolation: claims beside {args.load} requests of the deleted", flush=True)
            loaded = _timed_claims(port, hosts[other.community_id], secrets[0], args.claims)
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
            executor.execute("ROLLBACK")
            executor.close()
    conn.close()
    return {
        "baseline_p99_ms": percentile(baseline, 0.99) * 1000,
        "loaded_p99_ms": percentile(loaded, 0.99) * 1000,
        "ratio": percentile(loaded, 0.99) / percentile(baseline, 0.99),
        "deleted_refused": refused[0],
    }


def purge(db, args: argparse.Namespace) -> dict[str, float]:
    setup_django(db.name)
    from workflow_delivery import services

    conn = db.connect()
    figures = {}
    phases = [("batched", args.batch_size, args.batch_seconds)]
    if not args.no_baseline:
        phases.append(("one transaction", args.rows * 20, 0))
    for label, batch_size, batch_seconds in phases:
        tenant = create_tenant(conn, "purge")
        print(f"purge ({label}): seeding {args.rows} deliveries", flush=True)
        seed_deliveries(conn, tenant, args.rows)
        services.transition_community(tenant.community_id, "quiescing")
        generation = services.transition_community(tenant.community_id, "fenced")
        holds: list[float] = []
        progress = _hold_timer(holds)

        started = time.perf_counter()
        services.purge_community(
            tenant.community_id,
            generation,
            batch_size=batch_size,
            batch_seconds=batch_seconds,
            progress=progress,
        )
        figures[label] = {
            "longest_hold_s": max(holds, default=0.0),
            "batches": len(holds),
            "total_s": time.perf_counter() - started,
        }
    conn.close()
    if "one transaction" in figures:
        figures["ratio"] = (
            figures["batched"]["longest_hold_s"] / figures["one transaction"]["longest_hold_s"]
        )
    return figures


def _hold_timer(holds: list[float]):
    """A purge's progress callback appending each batch's duration to ``holds``."""
    last = [time.perf_counter()]
    shown = [0.0]

    def progress(totals: dict[str, int]) -> None:
        now = time.perf_counter()
        holds.append(now - last[0])
        last[0] = now
        if now - shown[0] >= 5:
            shown[0] = now
            print(
                f"  {sum(totals.values())} rows deleted, {len(holds)} batches,"
                f" longest {max(holds) * 1000:.0f} ms",
                flush=True,
            )

    return progress


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with bench_database() as db:
        results = {"purge": purge(db, args), "isolation": isolation(db, args)}
    iso, pur = results["isolation"], results["purge"]
    print("| figure | value |\n|---|---|")
    print(f"| other community's claim p99, no deletion | {iso['baseline_p99_ms']:.1f} ms |")
    print(
        f"| other community's claim p99, {args.load} requests of a community being deleted "
        f"| {iso['loaded_p99_ms']:.1f} ms (x{iso['ratio']:.2f}) |"
    )
    batched = pur["batched"]
    print(
        f"| longest exclusive hold, {args.rows} deliveries purged in batches "
        f"| {batched['longest_hold_s'] * 1000:.1f} ms ({batched['batches']} batches,"
        f" {batched['total_s']:.0f} s) |"
    )
    if "one transaction" in pur:
        whole = pur["one transaction"]
        print(
            f"| the same purge in one transaction | {whole['longest_hold_s'] * 1000:.1f}"
            f" ms (batched / one: {pur['ratio']:.3f}) |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
