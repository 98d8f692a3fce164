"""The failover run's HTTP figures, computed from journal lines: each agent's last
request counts, settles and the first settle after each loss by server, and the
probes that make a run fail when a server never answered after a loss."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.psycopg3  # bench.chaos_check imports psycopg 3


def _records(*, admin_seconds: float | None = 0.5) -> list[dict]:
    loss = {"op": "failover", "t": 100.0, "killed_at": 100.0, "node": "node1", "kind": "kill"}
    stats = [
        # Running counts: only each process's last line counts.
        {"op": "http_stats", "pid": 1, "server": "uvicorn", "requests": 5, "hung": 1},
        {"op": "http_stats", "pid": 1, "server": "uvicorn", "requests": 9, "hung": 1},
        {"op": "http_stats", "pid": 2, "server": "gunicorn", "requests": 7, "unavailable": 3},
    ]
    probes = [
        {
            "op": "probe",
            "server": name,
            "since_loss": 20.0,
            "admin_first": "ok",
            "admin_seconds": admin_seconds,
            "api_first": "503 database_unavailable",
            "api_seconds": 1.5,
        }
        for name in ("uvicorn", "gunicorn")
    ]
    return [loss, *stats, *probes]


def _settles() -> dict[str, list[dict]]:
    def settle(t: float, server: str | None) -> dict:
        found = {"op": "finish", "t": t, "result": "settled"}
        return found if server is None else {**found, "server": server}

    return {
        "a": [settle(90.0, "uvicorn")],
        "b": [settle(112.5, "uvicorn")],
        "c": [settle(111.0, "gunicorn")],
        # A Consumer agent's settle names no server.
        "d": [settle(101.0, None)],
    }


def _checked(records: list[dict]):
    from bench.chaos_check import ChaosReport, _check_http

    report = ChaosReport(failovers_planned=1)
    report.failovers = [r for r in records if r["op"] == "failover"]
    _check_http(records, _settles(), report)
    return report


def test_requests_are_each_agents_last_counts_summed():
    report = _checked(_records())
    assert (report.http_requests, report.http_hung, report.http_unavailable) == (16, 1, 3)


def test_settles_and_the_first_settle_after_each_loss_are_by_server():
    report = _checked(_records())
    assert report.http_settles == {"uvicorn": 2, "gunicorn": 1}
    assert report.http_recovery_seconds == {"uvicorn": [12.5], "gunicorn": [11.0]}


def test_every_server_answering_after_the_loss_passes():
    report = _checked(_records())
    assert report.probes_ok
    summary = report.summary()
    assert summary["http_requests"] == 16 and summary["http_hung"] == 1
    assert len(summary["probes_after_failover"]) == 2


def test_a_server_whose_admin_never_answered_fails_the_run():
    report = _checked(_records(admin_seconds=None))
    assert not report.probes_ok
    assert not report.ok
