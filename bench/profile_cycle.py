"""Profile the client side of the claim → finish loop in one process (cProfile), beside
the hand-written psycopg loop of the benchmarks, on a private database.

    .venv/bin/python bench/profile_cycle.py --cycles 2000 --top 25 [--chain]

Prints the client CPU per cycle of both loops (with ``--chain`` also the one-statement
loops, ``finish_and_claim_next`` and the hand-written settle-and-claim, per delivery),
the CPU their PostgreSQL backends spent per cycle (read from /proc, so the server must
run on this machine), and the service loop's hottest functions; where the service
spends more than the baseline is what a change to that side can win.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.workers import (
    BASELINE_CLAIM,
    BASELINE_FINISH,
    BASELINE_FINISH_AND_CLAIM,
    LEASE_SECONDS,
)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per loop")
    parser.add_argument("--top", type=int, default=25, help="functions to list")
    parser.add_argument("--batch", type=int, default=0, help="also profile batches of N")
    parser.add_argument(
        "--chain", action="store_true", help="also the one-statement settle-and-claim loops"
    )
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.top < 1 or args.batch < 0:
        parser.error("--cycles and --top must be positive, --batch at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with common.bench_database("buzz_profile", quiet=True) as db:
        from workflow_delivery import services
        from workflow_delivery.protocol import Outcome

        with db.connect() as conn:
            tenant = common.create_tenant(conn, "profile")
            # Turns of 100 cycles claim targets 0-35 twice and 36-63 once (n % 64):
            # twice the even share, so no target runs dry.
            rows = 2 * (3 + 2 * args.batch + 2 * args.chain) * (args.cycles + 100) + 1000
            common.seed_deliveries(conn, tenant, rows, progress=False)
            common.vacuum(conn)
        community = tenant.community_id

        def service(n: int) -> None:
            lease, _ = services.claim_delivery(
                community, common.target_key(n), lease_seconds=LEASE_SECONDS
            )
            services.finish_delivery(lease, Outcome.FINISHED)

        raw = db.connect()
        cursor = raw.cursor()

        def baseline(n: int) -> None:
            target = common.target_key(n)
            cursor.execute(BASELINE_CLAIM, [community, target, LEASE_SECONDS], prepare=True)
            row = cursor.fetchone()
            cursor.execute(BASELINE_FINISH, [community, row[0], target, row[14]], prepare=True)
            cursor.fetchone()

        def cpu_per_cycle(loop, count: int) -> float:
            started = time.process_time()
            for n in range(count):
                loop(n)
            return (time.process_time() - started) / count

        from django.db import connection

        connection.ensure_connection()
        backends = {
            "baseline": raw.info.backend_pid,
            "service": connection.connection.info.backend_pid,
        }
        server_seconds = dict.fromkeys(backends, 0.0)
        loops = {"baseline": baseline, "service": service}
        if args.batch:

            def batch(n: int) -> None:
                claimed = services.claim_deliveries(
                    community, common.target_key(n), limit=args.batch
                )
                services.finish_deliveries([(lease, Outcome.FINISHED) for lease, _ in claimed])

            loops[f"batch of {args.batch}, per delivery"] = batch
        # Each loop's ratios are against the hand-written loop of its kind.
        against = dict.fromkeys(loops, "baseline")
        if args.chain:
            held: dict[str, object] = {}

            def chain_service(n: int) -> None:
                lease = held.get("service")
                if lease is None:
                    lease, _ = services.claim_delivery(
                        community, common.target_key(n), lease_seconds=LEASE_SECONDS
                    )
                answer = services.finish_and_claim_next(
                    lease,
                    Outcome.FINISHED,
                    target_pubkey=common.target_key(n + 1),
                    lease_seconds=LEASE_SECONDS,
                )
                held["service"] = answer.next[0] if answer.next else None

            def chain_baseline(n: int) -> None:
                current = held.get("baseline")
                if current is None:
                    target = common.target_key(n)
                    cursor.execute(BASELINE_CLAIM, [community, target, LEASE_SECONDS], prepare=True)
                    row = cursor.fetchone()
                    current = (row[0], target, row[14])
                following = common.target_key(n + 1)
                arguments = [community, *current, community, following, LEASE_SECONDS]
                cursor.execute(BASELINE_FINISH_AND_CLAIM, arguments, prepare=True)
                row = cursor.fetchone()
                held["baseline"] = None if row[1] is None else (row[1], following, row[15])

            hand, ours = "one statement, hand-written", "one statement, finish_and_claim_next"
            loops |= {hand: chain_baseline, ours: chain_service}
            backends |= {hand: backends["baseline"], ours: backends["service"]}
            server_seconds |= {hand: 0.0, ours: 0.0}
            against |= {hand: hand, ours: hand}
        for loop in loops.values():  # warm: connections, prepared statements, caches
            cpu_per_cycle(loop, 50)
        # Short turns, many rounds, median: load from elsewhere on the machine then
        # falls on every loop alike.
        chunk = 100
        samples: dict[str, list[float]] = {name: [] for name in loops}
        rounds = max(1, args.cycles // chunk)
        for _ in range(rounds):
            for name, loop in loops.items():
                before = _backend_cpu(backends[name]) if name in backends else 0.0
                per = cpu_per_cycle(loop, chunk)
                if name in backends:
                    server_seconds[name] += _backend_cpu(backends[name]) - before
                samples[name].append(per / args.batch if name.startswith("batch") else per)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        for name, value in medians.items():
            ratio = value / medians[against[name]]
            print(
                f"{name}: {value * 1e6:.0f} µs client CPU per cycle ({ratio:.2f} x {against[name]})"
            )
        # The kernel counts a process's CPU in clock ticks: summed over every round,
        # not a median of rounds too short to tick.
        server = {name: seconds / (rounds * chunk) for name, seconds in server_seconds.items()}
        for name, value in server.items():
            base = server[against[name]]
            ratio = value / base if base else float("nan")
            print(
                f"{name}: {value * 1e6:.0f} µs server CPU per cycle ({ratio:.2f} x {against[name]})"
            )
        profiler = cProfile.Profile(time.process_time)  # CPU, not time spent waiting
        profiler.enable()
        cpu_per_cycle(service, args.cycles)
        profiler.disable()
        print(f"\nservice loop, {args.cycles} cycles under cProfile:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
        raw.close()
    return 0


def _backend_cpu(pid: int) -> float:
    """The CPU seconds (user and system) the PostgreSQL backend ``pid`` has used."""
    return common.process_cpu(pid)[1]


if __name__ == "__main__":
    raise SystemExit(main())
