"""The operator commands through call_command: reap_deliveries, delivery_stats, demo_deliveries."""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection, connections

from buzz_project.demo import data as demo
from tests.support import factories
from tests.support.sessions import other_sessions
from workflow_delivery import keys, services
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.reaper import logger as reaper_logger
from workflow_delivery.services import claim_delivery, commit_deliveries


def run(command: str, *args: str, **options) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out, **options)
    return out.getvalue()


def expired_step(targets: int, owner=None) -> factories.Step:
    """A committed step whose deliveries are all claimed under leases already expired."""
    step = factories.Step(owner, targets=targets)
    commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    for target in step.targets:
        assert claim_delivery(step.community.id, target, lease_seconds=60)
    expire_leases(step.community.id)
    return step


def expire_leases(community_id, cursor=None) -> None:
    """Test-only shortcut: move the community's leases into the past."""
    statement = (
        "UPDATE workflow_agent_deliveries SET lease_until = now() - interval '1 minute' "
        "WHERE community_id = %s AND status = 'claimed'"
    )
    if cursor is not None:
        cursor.execute(statement, [community_id])
        return
    with connection.cursor() as own:
        own.execute(statement, [community_id])


def states(step: factories.Step) -> set[tuple[str, int]]:
    rows = WorkflowAgentDelivery.objects.filter(community=step.community)
    return set(rows.values_list("status", "lease_generation"))


@pytest.fixture
def healthy_and_fenced(db) -> tuple[factories.Step, factories.Step]:
    """Three expired leases in an active community, two in a quiescing one."""
    healthy = expired_step(3)
    fenced = expired_step(2)
    services.begin_deletion(fenced.community.id)
    return healthy, fenced


class SweepHook(logging.Handler):
    """Collects what the reaper logs and calls ``callback`` on each sweep line."""

    def __init__(self, callback: Callable[[logging.LogRecord], None]) -> None:
        super().__init__()
        self.callback = callback
        self.records: list[logging.LogRecord] = []

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.INFO]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if record.getMessage().startswith("sweep="):
            self.callback(record)


@pytest.fixture
def on_sweep() -> Iterator[Callable[[Callable[[logging.LogRecord], None]], SweepHook]]:
    handlers: list[logging.Handler] = []

    def install(callback: Callable[[logging.LogRecord], None]) -> SweepHook:
        hook = SweepHook(callback)
        reaper_logger.addHandler(hook)
        handlers.append(hook)
        return hook

    yield install
    for hook in handlers:
        reaper_logger.removeHandler(hook)


def test_one_sweep_reclaims_and_reports_the_skipped(healthy_and_fenced):
    healthy, fenced = healthy_and_fenced
    out = run("reap_deliveries")
    assert "reclaimed 3 expired leases; skipped 2 in communities that are not active" in out
    assert out.rstrip().endswith(" s")
    assert states(healthy) == {("pending", 2)}
    assert states(fenced) == {("claimed", 1)}


def test_small_batches_still_reclaim_everything(healthy_and_fenced):
    healthy, _ = healthy_and_fenced
    assert "reclaimed 3 expired leases" in run("reap_deliveries", "--batch-size", "1")
    assert states(healthy) == {("pending", 2)}


def test_dry_run_counts_per_community_and_writes_nothing(healthy_and_fenced):
    healthy, fenced = healthy_and_fenced
    before = list(WorkflowAgentDelivery.objects.order_by("id").values())
    out = run("reap_deliveries", "--dry-run")
    assert f"{healthy.community.host}: would reclaim 3" in out
    assert fenced.community.host not in out
    assert "would reclaim 3 expired leases; skipped 2" in out
    assert list(WorkflowAgentDelivery.objects.order_by("id").values()) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--loop", "--interval", "0"], "--interval must be a positive number of seconds"),
        (["--loop", "--interval", "-2"], "--interval must be a positive number of seconds"),
        (["--batch-size", "0"], "--batch-size must be a positive whole number"),
        (["--batch-size", "-5"], "--batch-size must be a positive whole number"),
        (["--loop", "--max-sweeps", "-1"], "--max-sweeps must be a positive whole number"),
        (["--max-sweeps", "2"], "--max-sweeps applies only with --loop"),
        (["--interval", "1"], "--interval applies only with --loop"),
        (["--batch-size", "many"], "invalid int value"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    with pytest.raises(CommandError, match=message):
        run("reap_deliveries", *args)


def test_bad_keyword_arguments_are_refused_too():
    with pytest.raises(CommandError, match="--interval must be a positive"):
        run("reap_deliveries", loop=True, interval=0)
    with pytest.raises(CommandError, match="--batch-size must be a positive"):
        run("reap_deliveries", batch_size=0)


# The loop closes its connection between passes (close_old_connections), which a
# test transaction would not survive: these tests commit for real.


@pytest.mark.django_db(transaction=True)
def test_max_sweeps_bounds_the_loop_and_each_sweep_logs_one_line(on_sweep):
    healthy = expired_step(3)
    hook = on_sweep(lambda record: None)
    out = run("reap_deliveries", "--loop", "--interval", "0.01", "--max-sweeps", "3")
    lines = hook.lines
    assert "done: 3 sweeps (0 failed), reclaimed 3 expired leases" in out
    assert len(lines) == 3
    assert lines[0].startswith("sweep=1 reclaimed=3 skipped_inactive=0 batches=1 seconds=")
    assert lines[2].startswith("sweep=3 reclaimed=0 ")
    assert states(healthy) == {("pending", 2)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_loop_and_restores_the_handlers(on_sweep, signum):
    def previous(signum, frame):  # pragma: no cover - must never be called
        raise AssertionError("the command's own handler should have caught the signal")

    original = signal.signal(signum, previous)
    try:
        # Raised from inside the second sweep's log line: while the loop runs, for sure.
        on_sweep(
            lambda record: (
                record.getMessage().startswith("sweep=2 ") and signal.raise_signal(signum)
            )
        )
        out = run("reap_deliveries", "--loop", "--interval", "0.01", "--max-sweeps", "50")
        assert f"stopped by {signal.Signals(signum).name}: 2 sweeps" in out
        assert signal.getsignal(signum) is previous
    finally:
        signal.signal(signum, original)


@pytest.mark.django_db(transaction=True)
def test_a_second_signal_exits_at_once(on_sweep):
    def twice(record: logging.LogRecord) -> None:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    on_sweep(twice)
    with pytest.raises(SystemExit) as exited:
        run("reap_deliveries", "--loop", "--interval", "0.01", "--max-sweeps", "50")
    assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.django_db(transaction=True)
def test_the_loop_survives_a_terminated_connection(on_sweep, monkeypatch):
    # A persistent connection, so the backend the test terminates is the one the
    # next sweep would use.
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", None)
    # No health check either: it would replace the terminated session before the
    # sweep met it (the project's default; the loop must survive without it).
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", False)
    first = expired_step(2)
    second = factories.Step(targets=2)
    commit_deliveries(second.community.id, second.created_at, second.new_deliveries())
    for target in second.targets:
        assert claim_delivery(second.community.id, target, lease_seconds=600)

    def terminate_after_first_sweep(record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("sweep=1 "):
            return
        loop_backend = connection.connection.info.backend_pid
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [loop_backend])
                assert cursor.fetchone()[0] is True
                expire_leases(second.community.id, cursor)
        finally:
            other.close()

    hook = on_sweep(terminate_after_first_sweep)
    out = run("reap_deliveries", "--loop", "--interval", "0.01", "--max-sweeps", "3")
    assert "done: 3 sweeps (1 failed), reclaimed 4 expired leases" in out
    failures = [r for r in hook.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split()[:2] for r in failures] == [
        ["sweep=2", "error=database_unavailable"]
    ]
    assert failures[0].exc_info is not None
    assert [line.split()[:2] for line in hook.lines] == [
        ["sweep=1", "reclaimed=2"],
        ["sweep=3", "reclaimed=2"],
    ]
    assert states(first) == {("pending", 2)}
    assert states(second) == {("pending", 2)}


@pytest.mark.django_db(transaction=True)
def test_serve_demo_serves_the_admin_beside_the_reaper_until_a_signal(on_sweep):
    healthy = expired_step(2)
    out = StringIO()
    pages: list[int] = []

    def visit_then_stop(record: logging.LogRecord) -> None:
        port = re.search(r"http://127\.0\.0\.1:(\d+)/admin/", out.getvalue()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/") as page:
            pages.append(page.status)
        signal.raise_signal(signal.SIGTERM)

    on_sweep(visit_then_stop)
    call_command("serve_demo", "127.0.0.1:0", "--interval", "0.01", stdout=out)
    assert pages == [200]
    assert "reaper stopped by SIGTERM: 1 sweeps (0 failed), reclaimed 2 expired leases" in (
        out.getvalue()
    )
    assert states(healthy) == {("pending", 2)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.psycopg3  # the agent API's wait listens with psycopg 3
def test_serve_demo_runs_http_agents_that_settle_deliveries_through_the_api(on_sweep):
    run("demo_deliveries")
    settled = WorkflowAgentDelivery.objects.terminal()
    before = settled.count()
    out = StringIO()
    deadline = time.monotonic() + 15
    # As after an agent's first wait: the process's wake listener is running.
    from workflow_delivery.api import wake

    assert wake.hub.ensure_listening()

    def stop_once_settled(record: logging.LogRecord) -> None:
        if settled.count() >= before + 3 or time.monotonic() > deadline:
            signal.raise_signal(signal.SIGTERM)

    on_sweep(stop_once_settled)
    call_command("serve_demo", "127.0.0.1:0", "--interval", "0.2", "--http-agents", "2", stdout=out)
    text = out.getvalue()
    assert "2 HTTP agents on /agents/" in text
    counts = dict(
        (name, int(value))
        for name, value in re.findall(r"(\w+) (\d+)", text.split("HTTP agents stopped: ")[1])
    )
    assert "http_errors" not in counts
    done = counts.get("http_finished", 0) + counts.get("http_failed", 0)
    assert done == counts["http_claimed"]
    assert settled.count() == before + done >= before + 3
    # The process's wake listener (GET v1/wait's) went with the server instead of
    # outliving it and logging the embedded database's shutdown as a lost connection.
    assert "workflow-delivery-wake" not in {thread.name for thread in threading.enumerate()}


@pytest.mark.django_db(transaction=True)
def test_serve_demo_without_demo_data_runs_no_http_agents(on_sweep):
    out = StringIO()
    on_sweep(lambda record: signal.raise_signal(signal.SIGTERM))
    call_command("serve_demo", "127.0.0.1:0", "--interval", "0.01", stdout=out)
    assert "0 HTTP agents" in out.getvalue()
    assert "no active demo community: no HTTP agents" in out.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nowhere"], "address must be host:port"),
        (["127.0.0.1:0", "--interval", "0"], "--interval must be a positive number"),
        (["127.0.0.1:0", "--http-agents", "-1"], "--http-agents must be zero or more"),
    ],
)
def test_serve_demo_bad_arguments_are_refused(args, message):
    with pytest.raises(CommandError, match=message):
        run("serve_demo", *args)


def test_delivery_stats_counts_per_community_and_status(db, raw):
    busy = factories.Step(targets=3)
    commit_deliveries(busy.community.id, busy.created_at, busy.new_deliveries())
    raw.execute(
        "UPDATE workflow_agent_deliveries SET created_at = now() - interval '90 minutes' "
        "WHERE community_id = %s",
        [busy.community.id],
    )
    assert claim_delivery(busy.community.id, busy.targets[0], lease_seconds=60)
    expire_leases(busy.community.id)
    stale = expired_step(2)
    services.begin_deletion(stale.community.id)
    idle = factories.community()

    stats = json.loads(run("delivery_stats", "--json"))
    by_host = {row["host"]: row for row in stats["communities"]}
    assert by_host[busy.community.host]["counts"] == {
        "pending": 2,
        "claimed": 1,
        "finished": 0,
        "failed": 0,
    }
    assert by_host[busy.community.host]["oldest_pending_seconds"] == 5400
    assert by_host[busy.community.host]["expired_leases"] == 1
    assert by_host[stale.community.host]["state"] == "quiescing"
    assert by_host[stale.community.host]["expired_leases"] == 2
    assert by_host[stale.community.host]["oldest_pending_seconds"] is None
    assert by_host[idle.host]["counts"] == dict.fromkeys(
        ["pending", "claimed", "finished", "failed"], 0
    )
    assert stats["totals"] == {
        "pending": 2,
        "claimed": 3,
        "finished": 0,
        "failed": 0,
        "expired_leases": 3,
    }

    text = run("delivery_stats").splitlines()
    assert text[0].split() == [
        "community", "state", "pending", "claimed", "finished", "failed",
        "oldest", "pending", "expired", "leases",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in text[1:]}
    assert rows[busy.community.host] == ["active", "2", "1", "0", "0", "1h30m", "1"]
    assert rows[stale.community.host] == ["quiescing", "0", "2", "0", "0", "-", "2"]
    assert rows["total"] == ["2", "3", "0", "0", "3"]


def demo_snapshot() -> list[tuple]:
    return list(
        WorkflowAgentDelivery.objects.order_by("id").values_list(
            "id", "status", "lease_generation", "lease_until", "finished_at"
        )
    )


@pytest.mark.django_db(transaction=True)
def test_demo_deliveries_is_idempotent():
    first = run("demo_deliveries")
    snapshot = demo_snapshot()
    second = run("demo_deliveries")

    totals = "3 communities, 9 workflows, 18 runs, 36 message events, 108 deliveries"
    assert f"demo data: {totals} (108 deliveries new)" in first
    assert f"{demo.QUIESCING_HOST} moved to quiescing" in first
    assert f"demo data: {totals} (0 deliveries new)" in second
    assert f"{demo.QUIESCING_HOST} is not active: left as it is" in second
    assert demo_snapshot() == snapshot

    rows = WorkflowAgentDelivery.objects.all()
    kinds = set(rows.values_list("cause_kind", "status"))
    assert kinds == {
        (cause, status)
        for cause in ("event", "schedule", "webhook")
        for status in ("pending", "claimed", "finished", "failed")
    }
    expired = rows.expired_leases()
    assert expired.in_active_communities().count() == 12
    assert expired.in_fenced_communities().count() == 6
    assert set(expired.values_list("cause_kind", flat=True)) == {"event", "schedule", "webhook"}


@pytest.mark.django_db(transaction=True)
def test_demo_data_of_older_agent_keys_is_left_alone(raw):
    run("demo_deliveries")
    alpha = demo.demo_uuid("alpha.demo.buzz")
    # As an older demo stored it: a target that is no agent's public key (an agent of
    # the roster, as the migration enrolls the targets it finds).
    stale = demo.demo_key("alpha.demo.buzz", "agent", "scout")
    raw.execute(
        "INSERT INTO community_agents (community_id, pubkey) VALUES (%s, %s)", [alpha, stale]
    )
    raw.execute(
        "UPDATE workflow_agent_deliveries SET target_pubkey = %s WHERE id = "
        "(SELECT id FROM workflow_agent_deliveries WHERE community_id = %s LIMIT 1)",
        [stale, alpha],
    )
    snapshot = demo_snapshot()
    out = run("demo_deliveries")
    assert "alpha.demo.buzz holds deliveries of an older demo's agent keys" in out
    assert "(0 deliveries new)" in out
    assert demo_snapshot() == snapshot


@pytest.mark.django_db(transaction=True)
def test_demo_data_loads_again_beside_a_key_someone_enrolled_and_served():
    run("demo_deliveries")
    alpha = demo.demo_uuid("alpha.demo.buzz")
    own = bytes.fromhex(keys.new_key_pair()[1])
    services.enroll_agent(alpha, own, label="mine")
    sent = services.send_message(alpha, targets=[own], content="hi", idempotency_key="mine")
    snapshot = demo_snapshot()
    out = run("demo_deliveries")
    assert "older demo" not in out
    assert "(0 deliveries new)" in out
    assert demo_snapshot() == snapshot
    assert WorkflowAgentDelivery.objects.get(id=sent.deliveries[0].id).status == "pending"


@pytest.mark.django_db(transaction=True)
def test_demo_superuser_is_created_then_its_password_reset(monkeypatch, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    monkeypatch.setenv("DEMO_ADMIN_PASSWORD", "first-secret")
    assert "superuser admin created" in run("demo_deliveries", "--superuser", "admin")
    monkeypatch.setenv("DEMO_ADMIN_PASSWORD", "second-secret")
    assert "superuser admin password reset" in run("demo_deliveries", "--superuser", "admin")
    user = get_user_model().objects.get(username="admin")
    assert user.is_superuser and user.is_staff
    assert user.check_password("second-secret")
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD")
    with pytest.raises(CommandError, match="DEMO_ADMIN_PASSWORD"):
        run("demo_deliveries", "--superuser", "admin")


@pytest.mark.django_db(transaction=True)
def test_simulated_agents_settle_deliveries_and_close_their_connections():
    run("demo_deliveries")
    settled_before = WorkflowAgentDelivery.objects.terminal().count()
    out = run("demo_deliveries", "--agents", "3", "--seconds", "0.5", verbosity=0)
    assert "agents done: claimed " in out
    assert "crashed 1" in out  # the third agent claims once, then abandons the lease
    assert "errors" not in out
    assert WorkflowAgentDelivery.objects.terminal().count() > settled_before
    # A backend leaves pg_stat_activity a moment after its client hung up; a leaked
    # connection stays.
    deadline = time.monotonic() + 3
    while other_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert other_sessions() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agents", "-1"], "--agents must be zero or more"),
        (["--agents", "2", "--seconds", "0"], "--seconds must be a positive number"),
    ],
)
def test_demo_bad_arguments_are_refused(args, message):
    with pytest.raises(CommandError, match=message):
        run("demo_deliveries", *args)
