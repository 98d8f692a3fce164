"""Which fillfactor suits the delivery table: run the same claim → finish loop at each
fillfactor on a fresh table and report how many updates were HOT (the only thing free
space in a page buys), the table's size and the loop's rate.

    .venv/bin/python bench/fillfactor.py --rows 20000 --cycles 5000 --fillfactors 100 90 70
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from bench import common

STATS = """
SELECT n_tup_upd, n_tup_hot_upd, pg_relation_size('workflow_agent_deliveries')
  FROM pg_stat_user_tables WHERE relname = 'workflow_agent_deliveries'
"""


RESET_STATS = "SELECT pg_stat_reset_single_table_counters('workflow_agent_deliveries'::regclass)"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="pending rows seeded")
    parser.add_argument("--cycles", type=int, default=5_000, help="claim → finish cycles")
    parser.add_argument("--fillfactors", type=int, nargs="+", default=[100, 90, 70])
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.rows < args.cycles:
        parser.error("--cycles must be positive and --rows at least --cycles")
    if any(not 10 <= value <= 100 for value in args.fillfactors):
        parser.error("a fillfactor is between 10 and 100")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with common.bench_database("buzz_fillfactor", quiet=True) as db:
        from django.db import connections

        from workflow_delivery import services
        from workflow_delivery.protocol import Outcome

        print("fillfactor  updates  HOT  table size  cycles/s")
        for fillfactor in args.fillfactors:
            with db.connect() as conn:
                common.truncate_deliveries(conn)
                conn.execute(
                    f"ALTER TABLE workflow_agent_deliveries SET (fillfactor = {fillfactor})"
                )
                tenant = common.create_tenant(conn, f"ff{fillfactor}")
                common.seed_deliveries(conn, tenant, args.rows, progress=False)
                common.vacuum(conn)
                conn.execute(RESET_STATS)
            started = time.monotonic()
            for n in tqdm(range(args.cycles), desc=f"fillfactor {fillfactor}", leave=False):
                claimed = services.claim_delivery(tenant.community_id, common.target_key(n))
                services.finish_delivery(claimed[0], Outcome.FINISHED)
            rate = args.cycles / (time.monotonic() - started)
            # A backend reports its table statistics when it ends.
            connections.close_all()
            time.sleep(1.5)
            with db.connect() as conn:
                updates, hot, size = conn.execute(STATS).fetchone()
            print(
                f"{fillfactor:>10}  {updates:>7}  {hot:>3}  {size / 2**20:>8.1f} MB  {rate:>8.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
