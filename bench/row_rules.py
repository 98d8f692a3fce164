"""What each rule costs a producer's row: 100-target steps inserted through the
service's statement, then again with one group of rules taken away at a time (on a
private, throw-away database): the timeline's "committed" row, the fence trigger, the
roster check (each target an enabled agent), the one-message-per-step trigger, the
composite foreign keys, the secondary indexes. Each line reports µs per row and the
share of the full cost.

    .venv/bin/python bench/row_rules.py --steps 200 --targets 100
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from bench import common

TABLE = "workflow_agent_deliveries"
TURNS_TABLE = "workflow_delivery_agent_turns"
FOREIGN_KEYS = """
SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
 WHERE conrelid = 'workflow_agent_deliveries'::regclass AND contype = 'f'
"""
SECONDARY_INDEXES = """
SELECT indexname, indexdef FROM pg_indexes
 WHERE tablename = 'workflow_agent_deliveries'
   AND indexname NOT IN ('workflow_agent_deliveries_pkey', 'wd_delivery_identity_key')
   AND indexname NOT IN (SELECT conname FROM pg_constraint
                          WHERE conrelid = 'workflow_agent_deliveries'::regclass)
"""


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per variant")
    parser.add_argument("--targets", type=int, default=100, help="deliveries per step")
    args = parser.parse_args(argv)
    if args.steps < 1 or not 1 <= args.targets <= 1000:
        parser.error("--steps must be positive, --targets from 1 to 1000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with common.bench_database("buzz_rules", quiet=True) as db:
        from workflow_delivery.store import statements as sql

        statement = sql.LOCK_AND_INSERT_DELIVERIES
        with db.connect() as conn:
            tenant = common.create_tenant(conn, "rules")
            keys = conn.execute(FOREIGN_KEYS).fetchall()
            indexes = conn.execute(SECONDARY_INDEXES).fetchall()
        t = tenant
        targets = [n.to_bytes(32, "big") for n in range(args.targets)]

        def run(label: str, conn) -> float:
            conn.execute(f"TRUNCATE {TABLE}, workflow_delivery_timeline, {TURNS_TABLE}")
            started = time.perf_counter()
            for step in tqdm(range(args.steps), desc=label, leave=False):
                step_id = f"{label}-{step}"
                columns = [
                    [uuid.uuid4() for _ in targets],
                    *([value] * len(targets) for value in (t.community_id, t.workflow_id,
                                                           t.run_id, step_id)),
                    targets,
                    *([value] * len(targets) for value in (t.definition_id, t.message_id,
                                                           t.message_created_at, "event",
                                                           t.cause_id, None, None)),
                ]  # fmt: skip
                params = dict(zip(sql.INSERT_TYPES, columns, strict=True))
                params.update(community=t.community_id, run=t.run_id, step=step_id)
                with conn.transaction():
                    conn.execute(statement.text, params, prepare=True)
            return (time.perf_counter() - started) / (args.steps * args.targets) * 1e6

        results: list[tuple[str, float]] = []
        with db.connect() as conn:
            run("warm-up", conn)
            results.append(("every rule", run("full", conn)))
            conn.execute("SET workflow_delivery.timeline = 'off'")
            results.append(("without the timeline's row", run("notimeline", conn)))
            for trigger in ("wd_community_write_fence", "wd_community_write_fence_insert"):
                conn.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER {trigger}")
            results.append(("… and without the fence trigger", run("nofence", conn)))
            conn.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER wd_delivery_target_enrolled_insert")
            results.append(("… and without the roster check", run("noroster", conn)))
            conn.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER wd_delivery_one_message_per_step")
            results.append(("… and without one message per step", run("nostep", conn)))
            for name, _ in keys:
                conn.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT {name}")
            results.append((f"… and without {len(keys)} foreign keys", run("nofk", conn)))
            for name, _ in indexes:
                conn.execute(f"DROP INDEX {name}")
            results.append((f"… and without {len(indexes)} secondary indexes", run("bare", conn)))
        full = results[0][1]
        for label, micros in results:
            print(f"{label:<40} {micros:7.1f} µs/row  ({micros / full:.2f} of every rule)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
