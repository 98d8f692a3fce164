"""A lease's length and clock: the default maximum, the bound both the system check and the
claim keep, a Lease of bad values refused, and expiry by the statement's clock, not the
transaction's, inside a long transaction."""

from __future__ import annotations

import time
import uuid

import pytest
from django.db import connection, transaction

from tests.support import factories
from workflow_delivery import checks, services
from workflow_delivery.exceptions import InvalidLeaseSeconds, ProtocolError
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import Lease, LeaseLost, Outcome, Renewed
from workflow_delivery.validation import LEASE_SECONDS_BOUND


def test_an_expired_lease_cannot_renew_or_finish_inside_a_long_transaction(db):
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic():
        lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=1)
        time.sleep(1.2)
        assert services.renew_delivery(lease, lease_seconds=60) == LeaseLost()
        assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    assert WorkflowAgentDelivery.objects.get(pk=lease.delivery_id).status == "claimed"


def test_a_claim_late_in_a_long_transaction_hands_out_a_live_lease(db):
    step = factories.Step(targets=1)
    factories.committed(step)
    with transaction.atomic():
        time.sleep(1.1)
        lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=1)
        with connection.cursor() as c:
            c.execute("SELECT statement_timestamp()")
            assert lease.lease_until > c.fetchone()[0]
        assert isinstance(services.renew_delivery(lease, lease_seconds=1), Renewed)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("community_id", "x"),
        ("delivery_id", 7),
        ("target_pubkey", b"short"),
        ("generation", "1"),
        ("generation", -1),
        ("generation", 2**63),
        ("lease_until", "tomorrow"),
    ],
)
def test_a_lease_of_bad_values_is_a_protocol_error(field, value):
    from datetime import UTC, datetime

    fields = dict(
        community_id=uuid.uuid4(),
        delivery_id=uuid.uuid4(),
        target_pubkey=b"k" * 32,
        generation=1,
        lease_until=datetime.now(UTC),
    )
    fields[field] = value
    with pytest.raises(ProtocolError) as caught:
        Lease(**fields)
    assert caught.value.field == field


def test_the_default_maximum_lease_is_seven_days():
    from django.conf import settings

    from workflow_delivery.conf import DEFAULTS

    assert (
        DEFAULTS["MAX_LEASE_SECONDS"] == 7 * 86400 == settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS
    )


@pytest.mark.parametrize("maximum", [LEASE_SECONDS_BOUND + 1, 10**12])
def test_a_maximum_lease_beyond_the_bound_is_refused_by_the_system_check(settings, maximum):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = maximum
    found = [error for error in checks.check_settings() if error.id == "workflow_delivery.E006"]
    assert [error.msg for error in found] == [
        checks.E006_MSG.format(value=maximum, bound=LEASE_SECONDS_BOUND)
    ]


def test_a_lease_at_the_bound_is_handed_out_and_a_longer_one_is_refused(db, settings):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 10**12  # misconfigured: bounded anyway
    assert not [e for e in checks.check_settings() if e.id != "workflow_delivery.E006"]
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(
        step.community.id, step.targets[0], lease_seconds=LEASE_SECONDS_BOUND
    )
    assert lease.lease_until.year >= time.gmtime().tm_year + 9
    with pytest.raises(InvalidLeaseSeconds):
        services.claim_delivery(step.community.id, step.targets[1], lease_seconds=10**12)
    assert WorkflowAgentDelivery.objects.filter(status="pending").count() == 1
