"""The Prometheus exposition, parsed by prometheus_client's own parser and compared
with what the database holds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection
from django.db.models import Count, Min
from prometheus_client.parser import text_string_to_metric_families

from tests.support import factories
from workflow_delivery import services
from workflow_delivery.exceptions import CommunityWriteFenced, LeaseNotLive
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.store import statements as sql

pytestmark = pytest.mark.django_db


def scrape(client) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted labels: value}}`` of the /metrics page."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def growth(before: dict, after: dict) -> Callable[..., float]:
    """How much a counter (by name and label values) grew between two scrapes."""

    def grew(name: str, **label_values: str) -> float:
        key = tuple(sorted(label_values.items()))
        return after[name][key] - before[name][key]

    return grew


def labels(community: Community, **extra: str) -> tuple:
    community.refresh_from_db()
    return tuple(
        sorted({"community": community.host, "state": community.deletion_state, **extra}.items())
    )


def expire_all(community_id) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 minute' "
            "WHERE community_id = %s AND status = 'claimed'",
            [community_id],
        )


@pytest.fixture
def two_communities():
    busy = factories.Step(targets=6)
    factories.committed(busy)
    targets = iter(busy.targets)
    for outcome in ("finished", "finished", "failed"):
        lease, _ = services.claim_delivery(busy.community.id, next(targets))
        services.finish_delivery(lease, outcome)
    services.claim_delivery(busy.community.id, next(targets))
    expire_all(busy.community.id)
    services.claim_delivery(busy.community.id, next(targets))  # live
    quiet = factories.Step(targets=2)
    factories.committed(quiet)
    services.claim_delivery(quiet.community.id, quiet.targets[0])
    expire_all(quiet.community.id)
    services.begin_deletion(quiet.community.id)
    return busy.community, quiet


def test_per_community_figures_are_what_the_database_holds(client, two_communities):
    busy, quiet_step = two_communities
    quiet = quiet_step.community
    samples = scrape(client)
    for community in (busy, quiet):
        rows = WorkflowAgentDelivery.objects.filter(community=community)
        expected = dict(rows.values_list("status").annotate(n=Count("id")))
        for status in ("pending", "claimed", "finished", "failed"):
            value = samples["workflow_delivery_deliveries"][labels(community, status=status)]
            assert value == expected.get(status, 0)
    assert samples["workflow_delivery_expired_leases"][labels(busy)] == 1
    # The reaper never takes a quiescing community's lease: it is not reported as awaiting.
    assert labels(quiet) not in samples["workflow_delivery_expired_leases"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0]
    oldest = WorkflowAgentDelivery.objects.filter(community=busy, status="pending").aggregate(
        Min("created_at")
    )["created_at__min"]
    age = samples["workflow_delivery_oldest_pending_age_seconds"][labels(busy)]
    assert age == pytest.approx((now - oldest).total_seconds(), abs=1.0)


def test_counters_follow_what_this_process_did(client, two_communities):
    busy, quiet = two_communities
    before = scrape(client)
    step = factories.Step(busy, targets=2, step_id="counted")
    factories.committed(step)
    first, _ = services.claim_delivery(busy.id, step.targets[0])
    services.finish_delivery(first, "finished")
    services.finish_delivery(first, "failed")  # already terminal: not a settle, not lost
    second, _ = services.claim_delivery(busy.id, step.targets[1])
    expire_all(busy.id)
    services.renew_delivery(second)  # lost: expired
    reaped = services.reap_deliveries()
    with pytest.raises(CommunityWriteFenced):
        factories.committed(quiet)
    after = scrape(client)

    grew = growth(before, after)
    assert grew("workflow_delivery_claims_total") == 2
    assert grew("workflow_delivery_settles_total", outcome="finished") == 1
    assert grew("workflow_delivery_settles_total", outcome="failed") == 0
    assert grew("workflow_delivery_leases_lost_total") == 1
    assert grew("workflow_delivery_reaped_total", result="reclaimed") == reaped.reclaimed == 3
    assert grew("workflow_delivery_fence_refusals_total") >= 1


def test_batches_and_holding_blocks_are_counted_like_single_calls(
    client, django_capture_on_commit_callbacks
):
    step = factories.Step(targets=4, step_id="batched")
    factories.committed(step)
    before = scrape(client)
    claimed = [
        pair
        for target in step.targets[:2]
        for pair in services.claim_deliveries(step.community.id, target, limit=5)
    ]
    leases = [lease for lease, _ in claimed]
    # The first settles, its repeat is already terminal, the second fails.
    services.finish_deliveries(
        [(leases[0], "finished"), (leases[0], "failed"), (leases[1], "failed")]
    )
    third, _ = services.claim_delivery(step.community.id, step.targets[2])
    fourth, _ = services.claim_delivery(step.community.id, step.targets[3])
    # The test runs in a transaction: its commit callbacks run as the block ends.
    with django_capture_on_commit_callbacks(execute=True):
        with services.holding(third) as held:
            held.finish("finished")
        with pytest.raises(RuntimeError), services.holding(fourth) as held:
            held.finish("finished")
            raise RuntimeError("the block rolls back: its settle must not count")
    services.release_lease(fourth)
    with pytest.raises(LeaseNotLive), services.holding(fourth):
        pytest.fail("a released lease must not enter")
    after = scrape(client)

    grew = growth(before, after)
    assert grew("workflow_delivery_claims_total") == 4
    assert grew("workflow_delivery_settles_total", outcome="finished") == 2
    assert grew("workflow_delivery_settles_total", outcome="failed") == 1
    assert grew("workflow_delivery_leases_lost_total") == 1


def test_pruned_rows_are_counted(client):
    before = scrape(client)["workflow_delivery_pruned_total"][()]
    step = factories.Step(targets=2)
    factories.committed(step)
    for target in step.targets:
        lease, _ = services.claim_delivery(step.community.id, target)
        services.finish_delivery(lease, "finished")
    assert services.prune_deliveries(older_than="0s") == 2
    assert scrape(client)["workflow_delivery_pruned_total"][()] - before == 2


def test_only_get_is_served(client):
    assert client.post("/metrics").status_code == 405


@pytest.mark.django_db(transaction=True)
def test_the_figures_and_pruning_never_scan_the_table():
    """On a realistic, vacuumed table (most rows settled) the planner serves every
    metrics query and a prune batch from the partial indexes."""
    step = factories.Step(targets=1)
    with connection.cursor() as cursor:
        cursor.execute("SET workflow_delivery.timeline = off")  # seeding only
        try:
            cursor.execute(
                "INSERT INTO community_agents (community_id, pubkey) "
                "SELECT %s, sha256(int4send(n)) FROM generate_series(0, 63) AS n",
                [step.community.id],
            )
            cursor.execute(
                """
                INSERT INTO workflow_agent_deliveries (
                    id, community_id, workflow_id, run_id, step_id, target_pubkey,
                    definition_event_id, message_event_id, message_event_created_at,
                    cause_kind, cause_event_id, status, finished_at)
                SELECT gen_random_uuid(), %s, %s, %s, 'step-' || n,
                       sha256(int4send(n %% 64)), %s, %s, %s, 'event', sha256(int4send(n)),
                       CASE WHEN n %% 20 = 0 THEN 'pending' ELSE 'finished' END,
                       CASE WHEN n %% 20 = 0 THEN NULL ELSE now() END
                  FROM generate_series(1, 20000) AS n
                """,
                [
                    step.community.id,
                    step.workflow.id,
                    step.run.id,
                    step.definition_event_id,
                    bytes(step.message.id),
                    step.created_at,
                ],
            )
        finally:
            cursor.execute("RESET workflow_delivery.timeline")
        cursor.execute("VACUUM ANALYZE workflow_agent_deliveries")
        statements = [
            (sql.METRICS_PENDING, None),
            (sql.METRICS_CLAIMED, None),
            (sql.METRICS_TERMINAL, None),
            (sql.PRUNE_BATCH, {"cutoff": step.created_at, "limit": 1000}),
            (sql.PRUNE_COUNT, {"cutoff": step.created_at}),
        ]
        for statement, params in statements:
            cursor.execute(f"EXPLAIN {statement.sql}", statement.args(params))
            plan = "\n".join(line for (line,) in cursor.fetchall())
            assert "Seq Scan on workflow_agent_deliveries" not in plan, plan
