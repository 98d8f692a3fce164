"""Retry instead of destruction, on real PostgreSQL: a failing handler's delivery goes
back to pending behind a backoff that every claim path respects, keeps its last error
(type and message on the row, traceback in the timeline), and fails for good only at
the attempts cap or when the handler says so."""

from __future__ import annotations

import math
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client, override_settings
from django.urls import reverse

from tests.support import factories
from workflow_delivery import checks, history, services, wire
from workflow_delivery.api.wake import hub
from workflow_delivery.consumer import Consumer, PermanentFailure
from workflow_delivery.exceptions import (
    ConstraintViolation,
    ProtocolError,
    WorkflowDeliveryConfigurationError,
)
from workflow_delivery.models import DeliveryTransition, WorkflowAgentDelivery
from workflow_delivery.protocol import (
    ERROR_MESSAGE_MAX_LENGTH,
    AlreadyTerminal,
    DeliveryStatus,
    Exhausted,
    LeaseLost,
    Retried,
    Settled,
)
from workflow_delivery.store.errors import database_errors

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True, scope="module")
def stop_wake_listener():
    """The wait view starts this process's LISTEN connection; close it before the
    test database is dropped."""
    yield
    hub.stop()


def one_delivery(targets: list[bytes] | None = None) -> tuple[factories.Step, uuid.UUID]:
    step = factories.Step(targets=targets or 1)
    (delivery,) = factories.committed(step)
    return step, delivery.id


def claim(step: factories.Step, **options):
    options.setdefault("lease_seconds", 60)
    return services.claim_delivery(step.community.id, step.targets[0], **options)


def row(delivery_id: uuid.UUID) -> dict:
    return WorkflowAgentDelivery.objects.values().get(pk=delivery_id)


def timeline(delivery_id: uuid.UUID) -> list[dict]:
    """The delivery's history as the admin shows it (stored and implied entries)."""
    delivery = WorkflowAgentDelivery.objects.get(pk=delivery_id)
    keys = ("kind", "actor", "generation", "error_type", "error_message", "error_traceback")
    return [{key: getattr(e, key) for key in keys} for e in history.delivery_history(delivery)]


def stored_kinds(delivery_id: uuid.UUID) -> list[str]:
    entries = DeliveryTransition.objects.filter(delivery_id=delivery_id).order_by("id")
    return list(entries.values_list("kind", flat=True))


def database_seconds_until(instant) -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM %s - statement_timestamp())", [instant])
        return float(cursor.fetchone()[0])


def wait_for_database_clock(instant) -> None:
    deadline = time.monotonic() + 10
    while (left := database_seconds_until(instant)) > 0:
        assert time.monotonic() < deadline, "the database clock never reached the instant"
        time.sleep(min(left, 0.05) + 0.001)


def failing(message: str) -> RuntimeError:
    """An exception as a handler raises it: with a traceback."""
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


# -- through the consumer ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_handler_failing_twice_then_succeeding_finishes_on_its_third_attempt(
    settings, admin_client
):
    settings.WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS = 0.05
    settings.WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS = 0.1
    step, delivery_id = one_delivery()
    seen: list[int] = []

    def flaky(record, lease, context) -> None:
        seen.append(record.attempts)
        if record.attempts < 3:
            raise ValueError(f"upstream refused attempt {record.attempts}")

    consumer = Consumer(
        step.community.id,
        step.targets,
        flaky,
        lease_seconds=5,
        poll_interval=0.05,
        max_deliveries=3,
        listen=False,
    )
    runner = threading.Thread(target=consumer.run, daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
    assert seen == [1, 2, 3]
    assert consumer.stats.retried == 2 and consumer.stats.finished == 1
    assert consumer.stats.failed == 0

    stored = row(delivery_id)
    assert stored["status"] == "finished" and stored["attempts"] == 3
    assert stored["available_at"] is None
    assert stored["last_error_type"] == "ValueError"
    assert stored["last_error_message"] == "upstream refused attempt 2"
    kinds = [entry["kind"] for entry in timeline(delivery_id)]
    assert kinds == ["committed", "claimed", "retried", "claimed", "retried", "claimed", "finished"]
    # The retries and the claims they ended are stored; the rest is the row's own.
    assert stored_kinds(delivery_id) == ["claimed", "retried", "claimed", "retried"]
    retried = [entry for entry in timeline(delivery_id) if entry["kind"] == "retried"]
    assert [entry["actor"] for entry in retried] == ["holder", "holder"]
    assert all("in flaky" in entry["error_traceback"] for entry in retried)

    url = reverse("admin:workflow_delivery_workflowagentdelivery_change", args=[delivery_id])
    page = admin_client.get(url).content.decode()
    shown = '<code class="wd-error">ValueError: upstream refused attempt {}</code>'
    assert page.count(shown.format(1)) == 1
    # The second: in the timeline and as the delivery's last error.
    assert page.count(shown.format(2)) == 2
    assert page.count("<td>retried</td>") == 2
    assert "raise ValueError(f&quot;upstream refused attempt" in page


@pytest.mark.django_db(transaction=True)
def test_a_permanent_failure_fails_the_delivery_at_once_with_its_error_kept():
    step, delivery_id = one_delivery()

    def hopeless(record, lease, context) -> None:
        try:
            {}["payload"]
        except KeyError as exc:
            raise PermanentFailure("the message has no payload") from exc

    consumer = Consumer(
        step.community.id, step.targets, hopeless, poll_interval=0.05, max_deliveries=1
    )
    consumer.run()
    assert consumer.stats.failed == 1 and consumer.stats.retried == 0
    stored = row(delivery_id)
    assert stored["status"] == "failed" and stored["attempts"] == 1
    assert stored["last_error_type"] == "workflow_delivery.consumer.PermanentFailure"
    assert stored["last_error_message"] == "the message has no payload"
    last = timeline(delivery_id)[-1]
    assert last["kind"] == "failed" and last["actor"] == "holder"
    assert last["error_type"] == "workflow_delivery.consumer.PermanentFailure"
    # The traceback carries what it was raised from.
    assert "KeyError: 'payload'" in last["error_traceback"]


# -- the service ---------------------------------------------------------------------


def test_a_retried_delivery_waits_for_its_time_by_the_database_clock():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    result = services.retry_delivery(lease, error=failing("try later"), delay_seconds=1.5)
    assert isinstance(result, Retried) and result.attempts == 1
    assert 0 < database_seconds_until(result.available_at) <= 1.5
    stored = row(delivery_id)
    assert stored["status"] == "pending" and stored["lease_generation"] == lease.generation + 1
    assert stored["lease_until"] is None and stored["claimed_at"] is None
    assert stored["available_at"] == result.available_at

    assert claim(step) is None
    assert claim(step, delivery_id=delivery_id) is None
    assert services.claim_deliveries(step.community.id, step.targets[0], limit=5) == []

    wait_for_database_clock(result.available_at)
    again, record = claim(step)
    assert again.generation == lease.generation + 2
    assert record.attempts == 2 and record.available_at is None
    assert record.last_error.type == "RuntimeError" and record.last_error.message == "try later"
    assert row(delivery_id)["available_at"] is None


def test_both_claims_pass_over_a_backed_off_delivery_to_the_next():
    step = factories.Step(targets=1)
    first = factories.committed(step)[0].id
    later_step = factories.Step(owner=step.community, targets=step.targets, step_id="step-2")
    second = factories.committed(later_step)[0].id
    lease, record = claim(step)
    (other,) = {first, second} - {record.id}
    services.retry_delivery(lease, error="busy", delay_seconds=60)

    held, single = claim(step)
    assert single.id == other
    services.release_lease(held)
    batch = services.claim_deliveries(step.community.id, step.targets[0], limit=10)
    assert [record.id for _, record in batch] == [other]


def test_the_backoff_grows_with_the_attempts_up_to_its_cap_with_jitter(settings):
    settings.WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS = 10
    settings.WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS = 15
    step, delivery_id = one_delivery()
    waits = []
    for _ in range(3):
        lease, _record = claim(step)
        result = services.retry_delivery(lease, error="again")
        waits.append(database_seconds_until(result.available_at))
        with connection.cursor() as cursor:
            # Back-date the not-before time so the next claim can go ahead.
            cursor.execute(
                "UPDATE workflow_agent_deliveries SET available_at = NULL WHERE id = %s",
                [delivery_id],
            )
    # Attempt 1: 10 s, attempt 2: 20 s cut to 15, attempt 3: 40 s cut to 15; each
    # times a factor from 0.5 to 1 (less the moment that passed since).
    assert 4.5 <= waits[0] <= 10
    assert 7 <= waits[1] <= 15
    assert 7 <= waits[2] <= 15


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=2)
def test_the_attempts_cap_fails_the_delivery_as_attempts_exhausted():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    assert isinstance(services.retry_delivery(lease, error="first", delay_seconds=0), Retried)
    lease, _ = claim(step)
    result = services.retry_delivery(lease, error=failing("second"), delay_seconds=0)
    assert result == Exhausted(attempts=2)
    stored = row(delivery_id)
    assert stored["status"] == "failed" and stored["finished_at"] is not None
    assert stored["available_at"] is None
    assert stored["lease_generation"] == lease.generation + 1
    assert (stored["last_error_type"], stored["last_error_message"]) == ("RuntimeError", "second")
    last = timeline(delivery_id)[-1]
    assert (last["kind"], last["actor"], last["error_message"]) == (
        "attempts_exhausted",
        "holder",
        "second",
    )
    assert claim(step) is None


def test_a_failure_for_good_keeps_its_error_and_converges_on_a_repeat():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    error = failing("malformed")
    assert services.finish_delivery(lease, "failed", error=error) == Settled(outcome="failed")
    assert services.finish_delivery(lease, "failed", error=error) == AlreadyTerminal(
        status=DeliveryStatus.FAILED
    )
    stored = row(delivery_id)
    assert stored["status"] == "failed" and stored["lease_generation"] == lease.generation
    assert stored["last_error_message"] == "malformed"
    last = timeline(delivery_id)[-1]
    assert last["kind"] == "failed" and "RuntimeError: malformed" in last["error_traceback"]
    with pytest.raises(ProtocolError) as refused:
        services.finish_delivery(lease, "finished", error=error)
    assert refused.value.field == "error"


def test_a_stale_or_settled_lease_retries_nothing():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    assert isinstance(services.retry_delivery(lease, error="once", delay_seconds=0), Retried)
    before, entries = row(delivery_id), timeline(delivery_id)
    assert services.retry_delivery(lease, error="twice", delay_seconds=0) == LeaseLost()
    assert row(delivery_id) == before and timeline(delivery_id) == entries

    newer, _ = claim(step)
    assert isinstance(services.finish_delivery(newer, "finished"), Settled)
    settled = row(delivery_id)
    assert services.retry_delivery(newer, error="after the settle") == LeaseLost()
    assert row(delivery_id) == settled and settled["status"] == "finished"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"error": "x", "delay_seconds": -1}, "delay_seconds"),
        ({"error": "x", "delay_seconds": math.nan}, "delay_seconds"),
        ({"error": "x", "delay_seconds": math.inf}, "delay_seconds"),
        ({"error": "x", "delay_seconds": True}, "delay_seconds"),
        ({"error": "x", "delay_seconds": "5"}, "delay_seconds"),
        ({"error": "x", "delay_seconds": 10 * 366 * 86400}, "delay_seconds"),
        ({"error": 42}, "error"),
        ({"error": None}, "error"),
        ({"error": b"bytes"}, "error"),
        ({"error": "   "}, "error"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(options, field):
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    before = row(delivery_id)
    with pytest.raises(ProtocolError) as refused:
        services.retry_delivery(lease, **options)
    assert refused.value.field == field
    assert row(delivery_id) == before
    with pytest.raises(ProtocolError) as not_a_lease:
        services.retry_delivery(object(), error="x")
    assert not_a_lease.value.field == "lease"


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS="1")
def test_an_unusable_backoff_setting_is_named_and_changes_nothing():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    before = row(delivery_id)
    with pytest.raises(WorkflowDeliveryConfigurationError, match="RETRY_BACKOFF_SECONDS"):
        services.retry_delivery(lease, error="x")
    assert row(delivery_id) == before


def test_an_error_is_stored_within_its_bounds_whatever_it_holds():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    huge = failing("\x00" + "é" * 5000 + "\udcff")
    assert isinstance(services.retry_delivery(lease, error=huge, delay_seconds=0), Retried)
    record = services.get_delivery(step.community.id, delivery_id)
    assert len(record.last_error.message) == ERROR_MESSAGE_MAX_LENGTH
    assert record.last_error.message.startswith("\\x00éé") and record.last_error.message[-1] == "…"


def test_an_operator_can_still_fail_a_delivery_that_is_backing_off():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    services.retry_delivery(lease, error="later", delay_seconds=60)
    assert services.fail_deliveries(step.community.id, [delivery_id], operator="ann") == [
        delivery_id
    ]
    stored = row(delivery_id)
    assert stored["status"] == "failed" and stored["available_at"] is None


def test_a_reaped_lease_is_claimable_at_once():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    services.retry_delivery(lease, error="later", delay_seconds=0)
    claim(step)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 second' "
            "WHERE id = %s",
            [delivery_id],
        )
    assert services.reap_deliveries().reclaimed == 1
    assert row(delivery_id)["available_at"] is None
    assert claim(step) is not None


# -- the database's own rules --------------------------------------------------------


def raw_update(assignments: str, delivery_id: uuid.UUID, params: list | None = None) -> None:
    with transaction.atomic(), database_errors(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE workflow_agent_deliveries SET {assignments} WHERE id = %s",
            [*(params or []), delivery_id],
        )


@pytest.mark.parametrize(
    ("assignments", "params", "constraint"),
    [
        ("available_at = now()", [], "wd_delivery_available_at_only_pending"),
        ("last_error_type = 'E'", [], "wd_delivery_last_error_complete"),
        (
            "last_error_type = %s, last_error_message = '', last_error_at = now()",
            ["E" * 201],
            "wd_delivery_last_error_type_valid",
        ),
        (
            "last_error_type = ' ', last_error_message = '', last_error_at = now()",
            [],
            "wd_delivery_last_error_type_valid",
        ),
        (
            "last_error_type = 'E', last_error_message = %s, last_error_at = now()",
            ["m" * 2001],
            "wd_delivery_last_error_message_length",
        ),
    ],
)
def test_postgresql_refuses_an_error_or_backoff_out_of_its_rules(assignments, params, constraint):
    step, delivery_id = one_delivery()
    claim(step)
    with pytest.raises(ConstraintViolation) as refused:
        raw_update(assignments, delivery_id, params)
    assert refused.value.constraint == constraint


def test_a_settled_delivery_keeps_its_error_as_it_was():
    step, delivery_id = one_delivery()
    lease, _ = claim(step)
    services.finish_delivery(lease, "failed", error="bad")
    with pytest.raises(ConstraintViolation) as refused:
        raw_update("last_error_message = 'rewritten'", delivery_id)
    assert refused.value.constraint == "wd_delivery_terminal_once"
    # Only an operator's retry takes a failed delivery back (wd_delivery_retry_renews).
    with pytest.raises(ConstraintViolation) as reopened:
        raw_update("status = 'pending', finished_at = NULL, available_at = now()", delivery_id)
    assert reopened.value.constraint == "wd_delivery_retry_renews"


def test_a_retry_entry_always_carries_an_error():
    step, delivery_id = one_delivery()
    with (
        pytest.raises(ConstraintViolation) as refused,
        transaction.atomic(),
        database_errors(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "INSERT INTO workflow_delivery_timeline (community_id, delivery_id, at, kind, "
            "generation, attempts, status_before, status_after, actor) "
            "VALUES (%s, %s, now(), 'retried', 1, 1, 'claimed', 'pending', 'holder')",
            [step.community.id, delivery_id],
        )
    assert refused.value.constraint == "wd_timeline_error_kinds"


# -- the record, the API, the checks -------------------------------------------------


@pytest.mark.psycopg3  # the agent API's test helpers sign with the bench's psycopg 3 tools
def test_get_delivery_and_the_api_document_carry_the_last_error(settings):
    from tests.support.agent_http import pubkey, secret, signed

    settings.ALLOWED_HOSTS = ["*"]
    key = secret()
    step, delivery_id = one_delivery(targets=[pubkey(key)])
    lease, _ = claim(step)
    result = services.retry_delivery(lease, error=failing("rate limited"), delay_seconds=30)
    record = services.get_delivery(step.community.id, delivery_id)
    assert record.attempts == 1 and record.available_at == result.available_at
    assert (record.last_error.type, record.last_error.message) == ("RuntimeError", "rate limited")

    client = Client()
    host = step.community.host
    response = signed(client, "GET", f"v1/deliveries/{delivery_id}", host=host, secret_key=key)
    assert response.status_code == 200, response.content
    document = response.json()
    assert document["attempts"] == 1
    assert document["available_at"] == wire.instant(result.available_at)
    assert document["last_error"] == {
        "type": "RuntimeError",
        "message": "rate limited",
        "at": wire.instant(record.last_error.at),
    }
    assert wire.parse_delivery(document) == record

    # The wait's look for a pending delivery passes over it too.
    waited = signed(client, "GET", "v1/wait", host=host, secret_key=key, query="timeout=0")
    assert waited.status_code == 204, waited.content


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS": -1}, ["workflow_delivery.E020"]),
        ({"WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS": "300"}, ["workflow_delivery.E020"]),
        ({"WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS": math.inf}, ["workflow_delivery.E020"]),
        ({"WORKFLOW_DELIVERY_PURGE_BATCH_SECONDS": -0.5}, ["workflow_delivery.E020"]),
        (
            {
                "WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS": 10,
                "WORKFLOW_DELIVERY_RETRY_BACKOFF_MAX_SECONDS": 5,
            },
            ["workflow_delivery.E021"],
        ),
    ],
)
def test_settings_checks_report_an_unusable_backoff(overrides, expected):
    with override_settings(**overrides):
        errors = checks.check_settings()
    assert [error.id for error in errors] == expected
    if expected == ["workflow_delivery.E021"]:
        assert errors[0].msg == checks.E021_MSG.format(base=10, maximum=5)
    else:
        ((name, value),) = overrides.items()
        assert errors[0].msg == checks.E020_MSG.format(
            name=name.removeprefix("WORKFLOW_DELIVERY_"),
            bound=int(timedelta(days=3650).total_seconds()),
            value=value,
        )
