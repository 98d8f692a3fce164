"""Run the service benchmarks against a private database and print each figure
beside its baseline and bar.

    .venv/bin/python bench/run.py                      # everything
    .venv/bin/python bench/run.py throughput --seconds 5 --workers 4
    .venv/bin/python bench/run.py --seconds 2 --rows 20000 --json bench/results/quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.benchmarks import BENCHMARKS, Figure, Options
from bench.consumer_bench import CONSUMER_BENCHMARKS

BENCHMARKS = {**BENCHMARKS, **CONSUMER_BENCHMARKS}

POSTGRES_SETTINGS = [
    "shared_buffers",
    "work_mem",
    "effective_cache_size",
    "synchronous_commit",
    "fsync",
    "wal_level",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
    "jit",
]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "benchmarks",
        nargs="*",
        metavar="BENCHMARK",
        help=f"any of {', '.join(BENCHMARKS)} (default: all)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured start per phase")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (default 8; 4 for reap; latency runs at 1 and this)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=1_000_000,
        help="terminal rows of the history benchmark; isolation seeds rows/5 pending in the "
        "busy community and reap rows/10 expired leases (default 1,000,000)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating baseline/service rounds of throughput and producer",
    )
    parser.add_argument(
        "--prepared",
        dest="server_side_binding",
        action="store_true",
        help="also switch Django's own cursors to server-side binding and prepared "
        "statements (DATABASES OPTIONS server_side_binding=True, prepare_threshold=5); "
        "the app prepares its own statements either way",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    unknown = [name for name in args.benchmarks if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.seconds <= 0 or args.warmup < 0 or args.rows < 10 or args.rounds < 1:
        parser.error("--seconds must be positive, --rows at least 10, --rounds at least 1")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def _machine() -> dict[str, object]:
    memory = "unknown"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split("\n")[0].split()[1])
        memory = f"{kib / 1024 / 1024:.1f} GiB"
    return {
        "cores": os.cpu_count(),
        "memory": memory,
        "uname": " ".join(platform.uname()),
        "python": platform.python_version(),
    }


def _postgres(db: common.BenchDb) -> dict[str, str]:
    with db.connect() as conn:
        found = {"version": conn.execute("SELECT version()").fetchone()[0]}
        for name in POSTGRES_SETTINGS:
            found[name] = conn.execute(f"SHOW {name}").fetchone()[0]
    return found


def _cell(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def _table(figures: list[Figure]) -> str:
    header = ["benchmark", "figure", "value", "baseline", "unit", "ratio", "bar", "met"]
    rows = []
    for f in figures:
        bar = "—" if f.bar is None else (f"< {f.bar:g}" if f.bar_below else f"≥ {f.bar:g}x")
        met = {None: "—", True: "met", False: "NOT met"}[f.met]
        rows.append(
            [
                f.benchmark,
                f.name,
                _cell(f.value),
                _cell(f.baseline),
                f.unit,
                _cell(f.ratio, 3),
                bar,
                met,
            ]
        )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    rule = "-+-".join("-" * w for w in widths)
    head = " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    notes = [f"  {f.benchmark} / {f.name}: {n}" for f in figures for n in f.notes]
    return "\n".join([head, rule, *lines, *(["notes:", *notes] if notes else [])])


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    selected = args.benchmarks or list(BENCHMARKS)
    options = Options(
        seconds=args.seconds,
        warmup=args.warmup,
        workers=args.workers,
        rows=args.rows,
        rounds=args.rounds,
    )
    started = time.time()
    figures: list[Figure] = []
    with common.bench_database(quiet=True, server_side_binding=args.server_side_binding) as db:
        postgres = _postgres(db)
        for name in selected:
            began = time.monotonic()
            print(f"== {name}", file=sys.stderr, flush=True)
            figures += BENCHMARKS[name](db, options)
            print(f"   {name} took {time.monotonic() - began:.0f} s", file=sys.stderr)
    print(_table(figures))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "elapsed_seconds": round(time.time() - started, 1),
            "command": " ".join(["bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
            "options": {**vars(options), "server_side_binding": args.server_side_binding},
            "machine": _machine(),
            "postgres": postgres,
            "figures": [f.as_dict() for f in figures],
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the benchmark database was dropped", file=sys.stderr)
        sys.exit(130)
