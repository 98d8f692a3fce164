"""The consumer benchmarks run end to end at a tiny size and drop their database.
No figure is asserted: timings belong to bench/RESULTS.md, not to tests. (``recovery``
is left out: one round waits for a lease to run out, which takes 10 s or more.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.psycopg3
def test_consumer_benchmarks_run_and_drop_their_database(db, tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "bench" / "run.py"), "wake", "notify", "consumer"]
    command += ["consumer_next"]
    command += ["--seconds", "0.3", "--warmup", "0", "--workers", "1", "--rounds", "1"]
    command += ["--rows", "200", "--json", str(report)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "commit→claim" in out.decode()

    figures = json.loads(report.read_text())["figures"]
    by_benchmark = {f["benchmark"] for f in figures}
    assert by_benchmark == {"wake", "notify", "consumer", "consumer_next"}
    assert len([f for f in figures if f["benchmark"] == "notify"]) == 4
    # One process: the consumer against the one- and the two-statement loop.
    assert len([f for f in figures if f["benchmark"] == "consumer_next"]) == 2
    # Every measured figure is a number (a benchmark that saw nothing would give NaN).
    assert all(f["value"] == f["value"] for f in figures), figures

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", [f"buzz_bench_{proc.pid}"]
        )
        assert cursor.fetchone()[0] == 0
