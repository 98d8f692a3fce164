"""The benchmark harness runs end to end on a few rows and drops its database.
No figure is asserted: timings belong to bench/RESULTS.md, not to tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


# The harness runs on psycopg 3.
@pytest.mark.slow
@pytest.mark.psycopg3
def test_harness_runs_and_drops_its_database(db, tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "run.py"),
        "throughput",
        "reap",
        "batch",
        "bare",
        "producer",
        "reap_cliff",
    ]
    command += ["--seconds", "0.3", "--warmup", "0", "--workers", "1", "--rounds", "1"]
    command += ["--rows", "200", "--json", str(report)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]

    results = json.loads(report.read_text())
    names = {(f["benchmark"], f["name"].split(",")[0]) for f in results["figures"]}
    assert ("throughput", "claim+finish") in names
    assert any(benchmark == "reap" for benchmark, _ in names)
    assert {"batch", "bare"} <= {benchmark for benchmark, _ in names}
    producer = [f["name"] for f in results["figures"] if f["benchmark"] == "producer"]
    assert producer == [
        "1-target steps, 1 workers",
        "10-target steps, 1 workers",
        "10-target steps, wake-ups off, 1 workers",
    ]
    assert b"throughput" in out
    assert results["postgres"]["version"].startswith("PostgreSQL")

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", [f"buzz_bench_{proc.pid}"]
        )
        assert cursor.fetchone()[0] == 0


@pytest.mark.psycopg3  # the bench harness drives psycopg 3
@pytest.mark.slow
@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_api_bench_runs_and_drops_its_database(db, tmp_path: Path, server: str) -> None:
    report = tmp_path / "api.json"
    prefix = os.environ.get("BENCH_DB_PREFIX", "buzz_bench")
    command = [sys.executable, str(ROOT / "bench" / "api.py"), "--server", server]
    # A warm-up long enough for a cold server's first requests (its imports, its first
    # session) on a busy machine, so the window is never empty.
    command += ["--seconds", "0.5", "--warmup", "1", "--agents", "2", "--server-workers", "1"]
    # Enough rows that the service side (about 1 ms a cycle) cannot run dry during the
    # warm-up and leave nothing inside the window: 300 did, now and then.
    command += ["--rows", "4000", "--auth-calls", "20", "--waiters", "5", "--db-prefix", prefix]
    command += ["--runs", "1", "--batch", "2", "--wake-samples", "3"]
    command += ["--json", str(report)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]

    results = json.loads(report.read_text())
    # What the benchmark printed, to read when one of its figures is missing.
    printed = out.decode()[-3000:]
    (run,) = results["runs"]
    for label in (server, f"{server} batch of 2"):
        assert run[label]["service"]["cycles"] > 0, printed
        assert run[label]["http"]["cycles"] > 0, printed
        assert run[label]["ratio"] > 0, printed
    assert results["wake"][server]["p99_ms"] > 0, printed
    assert {"verify_us", "admission_us", "sign_us"} <= set(results["auth"])
    if server == "uvicorn":
        assert results["http_with_waiters"]["cycles"] > 0, printed
    assert f"| {server} / in-process |".encode() in out

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", [f"{prefix}_{proc.pid}"]
        )
        assert cursor.fetchone()[0] == 0


@pytest.mark.psycopg3  # the bench harness drives psycopg 3
@pytest.mark.slow
def test_acp_bench_api_mode_runs_and_drops_its_database(db) -> None:
    prefix = os.environ.get("BENCH_DB_PREFIX", "buzz_bench_acp")
    command = [sys.executable, "-m", "bench.acp_bench", "--api", "--deliveries", "4"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]
    printed = out.decode()
    for figure in (
        "API: turn ended -> settled p99 (ms)",
        "API: per delivery p50, plain HTTP agent (ms)",
        "API: runtime's own cost p50 (ms)",
        "API: lease lost -> cancel (ms)",
    ):
        assert figure in printed, printed
    assert "API: 3x lease: status: finished" in printed, printed
    assert "API: 3x lease: claims: 1" in printed, printed
    assert "API: replies committed after the loss: 0" in printed, printed

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", [f"{prefix}_{proc.pid}"]
        )
        assert cursor.fetchone()[0] == 0
