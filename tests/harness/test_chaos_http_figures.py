"""The failover run's HTTP figures, computed from journal lines: each agent's last
request counts, settles and the first settle after each loss by server, and the
probes that make a run fail when a server never answered after a loss."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.psycopg3  # bench.chaos_check imports psycopg 3


def _records(*, admin_seconds: float | None = 0.5) -> list[dict]:
    loss = {
        "op": "failover",
        "t": 100.0,
        "killed_at": 100.0,
        "node": "node1",
        "kind": "kill",
        "new_primary": "node2",
    }
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


def _wait(server: str, sent_at: float, seconds: float, answer: str, id_: str | None = None):
    return {
        "op": "http_wait",
        "t": sent_at + seconds,
        "server": server,
        "kind": "wait_claim",
        "wait": 10,
        "sent_at": sent_at,
        "seconds": seconds,
        "answer": answer,
        "id": id_,
    }


def _wait_records(*, gunicorn_woken: bool = True, hung_seconds: float = 5.0) -> list[dict]:
    sends = [
        # The waker's sends, and when each began.
        {"op": "commit", "t": 97.1, "ids": ["w1"], "t0": 97.0},
        {"op": "commit", "t": 115.1, "ids": ["w2"], "t0": 115.0},
        {"op": "commit", "t": 120.1, "ids": ["w3"], "t0": 120.0},
        # Found by the wait's first look: sent before the wait.
        {"op": "commit", "t": 129.9, "ids": ["w4"], "t0": 129.8},
    ]
    waits = [
        # Parked, then woken by w1 before the loss.
        _wait("uvicorn", 95.0, 2.2, "delivery", "w1"),
        # In flight at the loss (100.0): one answered 503, one empty once the
        # listener was back, one not answered within its bound.
        _wait("uvicorn", 98.0, 4.0, "unavailable"),
        _wait("gunicorn", 99.0, 12.0, "empty"),
        _wait("gunicorn", 99.5, hung_seconds, "connection_error"),
        # After the loss: woken by w2 on uvicorn.
        _wait("uvicorn", 112.0, 3.2, "delivery", "w2"),
        _wait("gunicorn", 130.0, 0.1, "delivery", "w4"),
    ]
    if gunicorn_woken:
        waits.append(_wait("gunicorn", 118.0, 2.3, "delivery", "w3"))
    return [*_records(), *sends, *waits]


def test_waits_are_counted_by_server_and_answer():
    report = _checked(_wait_records())
    assert report.waits_checked
    assert report.http_waits == {"uvicorn": 3, "gunicorn": 4}
    assert report.http_wait_answers == {
        "delivery": 4,
        "unavailable": 1,
        "empty": 1,
        "connection_error": 1,
    }
    assert report.http_waits_hung == 0


def test_waits_in_flight_at_a_loss_and_how_they_were_answered():
    report = _checked(_wait_records())
    assert report.http_waits_at_loss == {"uvicorn": [1], "gunicorn": [2]}
    assert report.http_waits_at_loss_answers == {
        "unavailable": 1,
        "empty": 1,
        "connection_error": 1,
    }
    assert report.http_waits_at_loss_max_seconds == 12.0


def test_only_a_wait_parked_before_its_send_counts_as_woken():
    report = _checked(_wait_records())
    # w4 was sent before its wait: answered by the first look, not woken.
    assert report.http_woken == {"uvicorn": 2, "gunicorn": 1}
    assert report.http_woken_after_failover == {"uvicorn": [1], "gunicorn": [1]}
    assert report.http_first_wake_seconds == {"uvicorn": [15.2], "gunicorn": [20.3]}
    assert report.waits_ok
    summary = report.summary()
    assert summary["http_waits_hung"] == 0
    assert summary["http_woken_after_failover"] == {"uvicorn": [1], "gunicorn": [1]}


def test_a_server_whose_waits_were_never_woken_after_a_loss_fails_the_run():
    report = _checked(_wait_records(gunicorn_woken=False))
    assert report.http_first_wake_seconds["gunicorn"] == [None]
    assert not report.waits_ok
    assert not report.ok
    assert "never" in report.render()


def test_a_wait_answered_past_its_bound_fails_the_run():
    report = _checked(_wait_records(hung_seconds=41.0))
    assert report.http_waits_hung == 1
    assert not report.waits_ok
    assert not report.ok


def test_a_run_without_waiting_agents_is_not_judged_on_waits():
    report = _checked(_records())
    assert not report.waits_checked and report.waits_ok
