"""The short chaos scenario with ``Consumer`` agents writing effects through ``holding()``.

Each delivery's handler writes one row into an effect table and settles in the same
lease-fenced block, while agents are killed (``kill -9``), stalled past their lease
(SIGSTOP), cut off (``pg_terminate_backend``) and the server restarts. It runs against a
throwaway PostgreSQL the harness starts for itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.psycopg3, pytest.mark.embedded_server]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    # Imported here so a host without psycopg 3 can still collect (and deselect) this.
    from bench.chaos import ChaosConfig, run

    config = ChaosConfig(
        agents=4,
        producers=2,
        seconds=12,
        lease=2,
        deliveries=160,
        reap_interval=0.5,
        kills=1,
        stalls=1,
        drops=4,
        restart=True,
        database_url=None,
        long_work_share=0.1,
        consumers=True,
        journal_dir=Path(tmp_path_factory.mktemp("chaos-consumers")),
    )
    return run(config)


def test_every_delivery_is_settled_once_with_exactly_one_effect(report):
    assert report.committed >= 150, report.render()
    assert report.settled == report.committed, report.render()
    assert report.settled_twice == 0 and report.contradictions == 0, report.render()
    assert report.lost == 0 and report.unrecorded == 0, report.render()
    assert report.effects_checked, report.render()
    assert report.effect_rows == report.committed, report.render()
    assert report.effects_missing == 0, report.render()
    assert report.effects_duplicated == 0, report.render()
    assert report.effects_stale == 0, report.render()


def test_the_faults_happened_and_stale_holders_were_refused(report):
    assert report.agents_killed >= 1, report.render()
    assert report.takeover_seconds, report.render()
    assert report.holders_stalled >= 1, report.render()
    assert report.stale_finishes_accepted == 0, report.render()
    assert sum(report.connections_dropped.values()) >= 1, report.render()
    assert report.restarts == 1 and report.reconnects >= 1, report.render()
    assert report.worker_errors == [], report.render()
    assert report.ok, report.render()
