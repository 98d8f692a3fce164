"""``manage.py consume_deliveries`` through call_command, on real PostgreSQL."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from tests.support import factories
from tests.support.consumer_handlers import CREATE_EFFECTS, EFFECTS
from workflow_delivery.models import WorkflowAgentDelivery

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = "tests.support.consumer_handlers"


@pytest.fixture
def effects():
    with connection.cursor() as cursor:
        cursor.execute(CREATE_EFFECTS)
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {EFFECTS}")


def consume(step: factories.Step, *extra: str, handler: str = "write_effect") -> str:
    out = StringIO()
    targets = [arg for target in step.targets for arg in ("--target", target.hex())]
    call_command(
        "consume_deliveries",
        "--community",
        str(step.community.id),
        *targets,
        "--handler",
        f"{HANDLERS}.{handler}",
        "--lease-seconds",
        "2",
        *extra,
        stdout=out,
    )
    return out.getvalue()


def test_consumes_up_to_max_deliveries_and_summarises(effects):
    step = factories.Step(targets=3)
    deliveries = factories.committed(step)
    output = consume(step, "--max-deliveries", "3", "--concurrency", "2")
    summary = output.strip().splitlines()[-1]
    assert summary.startswith("done: claimed=3 finished=3 failed=0 lost=0")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT delivery_id, count(*) FROM {EFFECTS} GROUP BY delivery_id")
        assert dict(cursor.fetchall()) == {d.id: 1 for d in deliveries}
    assert set(WorkflowAgentDelivery.objects.values_list("status", flat=True)) == {"finished"}


def test_a_failing_handler_gives_its_delivery_back_to_be_retried():
    step = factories.Step(targets=1)
    factories.committed(step)
    output = consume(step, "--max-deliveries", "1", handler="refuse")
    summary = output.strip().splitlines()[-1]
    assert "failed=0" in summary and "retried=1" in summary
    delivery = WorkflowAgentDelivery.objects.get()
    assert delivery.status == "pending" and delivery.available_at is not None
    assert delivery.last_error_message == "this handler always fails"


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=1)
def test_a_failing_handler_on_its_last_attempt_settles_failed():
    step = factories.Step(targets=1)
    factories.committed(step)
    output = consume(step, "--max-deliveries", "1", handler="refuse")
    assert "failed=1" in output.strip().splitlines()[-1]
    assert WorkflowAgentDelivery.objects.get().status == "failed"


def test_sigterm_stops_it_cleanly():
    step = factories.Step(targets=1)
    timer = threading.Timer(1.0, os.kill, [os.getpid(), signal.SIGTERM])
    timer.start()
    try:
        output = consume(step, "--poll-interval", "0.2", handler="do_nothing")
    finally:
        timer.cancel()
    assert output.strip().splitlines()[-1].startswith("stopped by SIGTERM: claimed=0")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--community", "nope"], "--community: no community has the id or host 'nope'"),
        (["--community", str(uuid.uuid4())], "--community: no community has the id or host"),
        (["--all-enrolled", "--target"], "name the targets with --target, or serve"),
        (["--roster-interval", "0"], "--roster-interval must be a positive number"),
        (["--target", "ab"], "--target must be 64 lowercase hex"),
        (["--target", "AB" * 32], "--target must be 64 lowercase hex"),
        (["--target", "zz" * 32], "--target must be 64 lowercase hex"),
        (["--handler", "tests.support.consumer_handlers.missing"], "cannot be imported"),
        (["--handler", "nodots"], "cannot be imported"),
        (["--handler", "tests.support.consumer_handlers.not_callable"], "is not callable"),
        (["--lease-seconds", "0"], "--lease-seconds must be a positive whole number"),
        (["--lease-seconds", "99999999"], "lease_seconds: must be between"),
        (["--concurrency", "0"], "--concurrency must be a positive whole number"),
        (["--max-deliveries", "0"], "--max-deliveries must be a positive whole number"),
        (["--poll-interval", "0"], "--poll-interval must be a positive number"),
        (["--grace-seconds", "-1"], "--grace-seconds must be >= 0"),
        (["--database", "nowhere"], "is not a configured alias"),
    ],
)
def test_bad_arguments_are_command_errors(args, message):
    step = factories.Step(targets=1)
    base = {
        "--community": str(step.community.id),
        "--target": step.targets[0].hex(),
        "--handler": f"{HANDLERS}.do_nothing",
    }
    flags = [flag for flag in args if flag == "--all-enrolled"]
    args = [arg for arg in args if arg != "--all-enrolled"]
    if args and args[-1] == "--target":
        args = []  # --all-enrolled with the base's --target
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = [item for pair in base.items() for item in pair] + flags
    with pytest.raises(CommandError, match=message):
        call_command("consume_deliveries", *argv, stdout=StringIO())


def test_all_enrolled_by_host_serves_every_agent_of_the_roster(effects):
    step = factories.Step(owner=factories.community("Roster.Example"), targets=3)
    factories.committed(step)
    out = StringIO()
    call_command(
        "consume_deliveries",
        "--community",
        "roster.example",
        "--all-enrolled",
        "--handler",
        f"{HANDLERS}.write_effect",
        "--max-deliveries",
        "3",
        stdout=out,
    )
    assert out.getvalue().strip().splitlines()[-1].startswith("done: claimed=3 finished=3")


def test_neither_targets_nor_the_roster_is_a_command_error():
    step = factories.Step(targets=1)
    argv = ["--community", str(step.community.id), "--handler", f"{HANDLERS}.do_nothing"]
    with pytest.raises(CommandError, match="name the targets with --target, or serve"):
        call_command("consume_deliveries", *argv, stdout=StringIO())
