"""The app's statements run prepared by default, or through Django's cursor when asked."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from tests import factories
from workflow_delivery import fence, services
from workflow_delivery.exceptions import CommunityWriteFenced
from workflow_delivery.protocol import Outcome, Settled


def cycle(step: factories.Step) -> Settled:
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    return services.finish_delivery(lease, Outcome.FINISHED)


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [statement for (statement,) in cursor.fetchall()]


@pytest.mark.psycopg3
def test_claim_and_finish_are_prepared_with_a_literal_pending(db):
    assert cycle(factories.Step()) == Settled(Outcome.FINISHED)
    statements = prepared_statements()
    claim = [text for text in statements if "FOR UPDATE SKIP LOCKED" in text]
    assert claim, statements
    # A literal lets the generic plan use the partial claim index.
    assert "= ('pending')" in claim[0]
    settle = "SET status = $1, finished_at = statement_timestamp()"
    assert any(settle in text for text in statements)


@pytest.mark.psycopg3
def test_prepared_statements_bypass_django_query_capture(db):
    step = factories.Step()
    with CaptureQueriesContext(connection) as captured:
        cycle(step)
    assert not any("SKIP LOCKED" in query["sql"] for query in captured.captured_queries)


@override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=False)
def test_setting_off_runs_through_djangos_cursor(db):
    step = factories.Step()
    with CaptureQueriesContext(connection) as captured:
        assert cycle(step) == Settled(Outcome.FINISHED)
    sql = [query["sql"] for query in captured.captured_queries]
    assert any("SKIP LOCKED" in text for text in sql)
    assert any("finished_at = statement_timestamp()" in text for text in sql)


@pytest.mark.parametrize("prepared", [True, False])
def test_fence_errors_map_the_same_either_way(db, prepared):
    step = factories.Step()
    factories.committed(step)
    fence.transition_community(step.community.id, "quiescing")
    with (
        override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared),
        pytest.raises(CommunityWriteFenced),
    ):
        services.claim_delivery(step.community.id, step.targets[0])


@pytest.mark.parametrize("prepared", [True, False])
def test_a_refused_statement_leaves_the_callers_transaction_usable(db, prepared):
    healthy, frozen = factories.Step(), factories.Step()
    fence.transition_community(frozen.community.id, "quiescing")
    with override_settings(WORKFLOW_DELIVERY_PREPARED_STATEMENTS=prepared), transaction.atomic():
        with pytest.raises(CommunityWriteFenced):
            services.commit_deliveries(
                frozen.community.id, frozen.created_at, frozen.new_deliveries()
            )
        created = services.commit_deliveries(
            healthy.community.id, healthy.created_at, healthy.new_deliveries()
        )
    assert len(created) == 1
    assert services.get_delivery(healthy.community.id, created[0]) is not None
