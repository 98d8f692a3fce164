"""Claim+finish with a synchronous standby against a lone server's commit, in one run.

    .venv/bin/python bench/sync_commit.py [--workers 1 4] [--seconds 10] [--rounds 2]
                                          [--json FILE]

Starts (or joins) the replicated cluster of ``scripts/ha`` (its ``HA_*`` variables choose
the ports and the folder), with synchronous replication, and works in a private database
on its primary. The hand-written claim+finish cycle (one statement claims, one finishes:
two commits a cycle) runs on sessions whose commits wait for the synchronous standby
(``synchronous_commit = on``, the cluster's setting) and on sessions with
``synchronous_commit = local``, whose commits wait for the primary's own disk only, as a
lone server's do. The two take turns in one-second slices of the same window, every
worker switching together, so the machine's load falls on both alike. The ratio is
synchronous / local; a standby that stopped being synchronous during the run fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.benchmarks import Options, _cycle_phase  # noqa: E402
from bench.chaos_server import HaTopology, connect  # noqa: E402
from bench.workers import BASELINE, BOTH, SERVICE  # noqa: E402

SYNC_STANDBYS = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"


def _sync_standbys(url: str) -> int:
    with connect(url) as conn:
        return conn.execute(SYNC_STANDBYS).fetchone()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per phase")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2, help="phases per worker count")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures here")
    args = parser.parse_args(argv)

    topology = HaTopology(synchronous=True)
    topology.start()
    node = topology.primary(timeout=5.0)
    if node is None:
        parser.error("the cluster has no primary")
    # The primary itself, not the multi-host URL: the figure is the commit's cost.
    admin = f"postgres://root@127.0.0.1:{topology.ports[node]}/postgres"
    os.environ["DATABASE_URL"] = admin
    if not _sync_standbys(admin):
        parser.error("the primary has no synchronous standby (scripts/ha start)")

    options = Options(seconds=args.seconds, warmup=args.warmup, rounds=args.rounds)
    rows = []
    with common.bench_database("buzz_sync_commit", quiet=True) as db:
        for workers in args.workers:
            synchronous, local = [], []
            for round_ in range(1, args.rounds + 1):
                desc = f"claim+finish, {workers} workers #{round_}"
                phase = _cycle_phase(db, BOTH, workers, options, desc, kind="cycle-sync")
                synchronous.append(phase.rate(api=SERVICE))
                local.append(phase.rate(api=BASELINE))
                if not _sync_standbys(admin):
                    print("sync_commit: the standby stopped being synchronous", file=sys.stderr)
                    return 1
            rows.append(
                {
                    "workers": workers,
                    "synchronous_standby": round(mean(synchronous), 1),
                    "local": round(mean(local), 1),
                    "ratio": round(mean(synchronous) / mean(local), 3),
                    "rounds": {"synchronous_standby": synchronous, "local": local},
                }
            )
    print(f"primary {node}, one synchronous standby, {args.rounds} x {args.seconds:g} s per row")
    print("| workers | synchronous standby, cycles/s | local commit, cycles/s | ratio |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['workers']} | {row['synchronous_standby']:.0f} | {row['local']:.0f} "
            f"| {row['ratio']:.2f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"primary": node, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
