"""What history costs the server per claim+finish: one process runs the service's
claim → finish loop beside ``--rows`` settled deliveries of the same targets (and
again beside none), with random delivery ids and with time-ordered ones
(``protocol.new_delivery_id()``), on a private, throw-away database. Each line
reports, per cycle, the WAL written and the blocks read from outside shared buffers
(both from the server's own counters, so another load on the machine does not move
them) and the wall time. Autovacuum is held off the two tables while the loop runs
(it would otherwise vacuum the small runs' tables halfway through, and its WAL would
count as theirs).

    .venv/bin/python bench/history_io.py --rows 1000000 --cycles 4000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

TABLES = ("workflow_agent_deliveries", "workflow_delivery_timeline")
# Blocks read from outside shared buffers, per table (heap, TOAST) and per index.
RELATION_READS = """
SELECT relname, heap_blks_read + coalesce(toast_blks_read, 0) FROM pg_statio_user_tables
UNION ALL
SELECT indexrelname, idx_blks_read FROM pg_statio_user_indexes
"""
COUNTERS = """
SELECT pg_current_wal_lsn(), blks_read FROM pg_stat_database WHERE datname = current_database()
"""


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="settled rows beside")
    parser.add_argument("--cycles", type=int, default=4000, help="claim+finish cycles")
    args = parser.parse_args(argv)
    if args.rows < 0 or args.cycles < 1:
        parser.error("--rows must be 0 or more, --cycles positive")
    return args


def _measure(db: common.BenchDb, history: int, cycles: int, ids: str) -> tuple[float, ...]:
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import Outcome

    with db.connect() as conn:
        # Every run starts from a checkpoint (cycle_tenant() ends with one): the
        # first change of each page after one writes the whole page to the WAL.
        tenant = common.cycle_tenant(
            conn, "io", cycles * 2, history=history, ids=ids, pending_progress=False
        )
    # A new session for the counters: a backend sends its own counts (the VACUUM's
    # reads) to the shared statistics at most once a second, or when it ends.
    time.sleep(1)
    with db.connect() as conn:
        lsn, reads = conn.execute(COUNTERS).fetchone()
        before = dict(conn.execute(RELATION_READS).fetchall())
        started = time.perf_counter()
        for n in range(cycles):
            lease, _ = services.claim_delivery(tenant.community_id, common.target_key(n))
            services.finish_delivery(lease, Outcome.FINISHED)
        elapsed = time.perf_counter() - started
        connections.close_all()
        # The statistics collector's figures for this database, read fresh.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        time.sleep(1)
        end_lsn, end_reads = conn.execute(COUNTERS).fetchone()
        relations = {
            name: (count - before.get(name, 0)) / cycles
            for name, count in conn.execute(RELATION_READS).fetchall()
        }
        wal = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", [end_lsn, lsn]).fetchone()[0]
    busiest = sorted(relations.items(), key=lambda item: -item[1])[:3]
    where = ", ".join(f"{name} {count:.2f}" for name, count in busiest if count >= 0.05)
    return float(wal) / cycles, (end_reads - reads) / cycles, elapsed / cycles, where


def _autovacuum(db: common.BenchDb, enabled: bool) -> None:
    with db.connect() as conn:
        for table in TABLES:
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = {enabled})")


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with common.bench_database("buzz_history_io", quiet=True) as db:
        _autovacuum(db, False)  # the database is dropped afterwards
        for ids in (common.RANDOM_IDS, common.ORDERED_IDS):
            for history in (0, args.rows):
                wal, reads, wall, where = _measure(db, history, args.cycles, ids)
                print(
                    f"{ids:8s} ids, {history:>9,} settled rows beside: {wal:8,.0f} B of WAL, "
                    f"{reads:5.2f} blocks read ({where or 'none'}), "
                    f"{wall * 1e6:6,.0f} µs a cycle",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
