"""What a reaped row costs: ``--rows`` expired leases reaped flat out (no rest between
batches) by the service, on a private, throw-away database, then again with the
timeline off for the app's sessions (``WORKFLOW_DELIVERY_TIMELINE = False``: neither
the trigger nor the reaper's statement records), then without the write fence's row
trigger. Each line reports µs per reaped row, the median of ``--rounds``.

    .venv/bin/python bench/reap_rows.py --rows 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

# Per variant: whether the timeline records, and the triggers disabled.
VARIANTS = {
    "every rule": (True, ()),
    "without the timeline": (False, ()),
    "without the fence's row trigger": (True, ("wd_community_write_fence",)),
}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="expired leases per sweep")
    parser.add_argument("--rounds", type=int, default=3, help="sweeps per variant")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.rounds < 1:
        parser.error("--rows and --rounds must be positive")
    return args


def _sweep(db: common.BenchDb, rows: int, timeline: bool, disabled: tuple[str, ...]) -> float:
    from django.test import override_settings

    from workflow_delivery import services

    with db.connect() as conn:
        common.truncate_deliveries(conn)
        tenant = common.create_tenant(conn, "reap")
        common.seed_deliveries(conn, tenant, rows, state=common.EXPIRED, progress=False)
        common.vacuum(conn)
        for trigger in disabled:
            conn.execute(f"ALTER TABLE workflow_agent_deliveries DISABLE TRIGGER {trigger}")
    try:
        with override_settings(WORKFLOW_DELIVERY_TIMELINE=timeline):
            started = time.perf_counter()
            reaped = services.reap_expired_deliveries(yield_ratio=0)
            elapsed = time.perf_counter() - started
    finally:
        with db.connect() as conn:
            for trigger in disabled:
                conn.execute(f"ALTER TABLE workflow_agent_deliveries ENABLE TRIGGER {trigger}")
    if reaped != rows:
        raise RuntimeError(f"reaped {reaped} of {rows} expired leases")
    return elapsed / rows


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with common.bench_database("buzz_reap_rows", quiet=True) as db:
        costs = {name: [] for name in VARIANTS}
        # Variants take turns, round after round: drift on the machine falls on all.
        for _ in range(args.rounds):
            for name, (timeline, disabled) in VARIANTS.items():
                costs[name].append(_sweep(db, args.rows, timeline, disabled))
                print(f"  {name}: {costs[name][-1] * 1e6:.1f} µs", file=sys.stderr, flush=True)
        full = statistics.median(costs["every rule"])
        for name, values in costs.items():
            cost = statistics.median(values)
            print(f"{name:34s} {cost * 1e6:7.1f} µs a row ({cost / full:.0%} of every rule)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
