"""The "why not delivered?" page tells a consumer waiting for a wake-up from one that
died without taking its idle registration back: the registration names the session
that listens for the wake-up, and the page looks that session up in pg_stat_activity.

Consumers run as ``manage.py consume_deliveries`` subprocesses where one must die
(SIGKILL leaves no chance to unregister), on a thread where only its listening session
is ended. An unprivileged role sees its own sessions' start, so the page works for it;
another role's session shows no start, which the page says it cannot judge. A test
module that needs psycopg 3 (the wake listener): the psycopg2 cell leaves it out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from tests.admin.test_admin_target import figure, headline, verdict_kinds
from tests.store.test_app_role import as_role, dropped_afterwards
from tests.support import factories
from tests.support.admin_pages import committed
from tests.support.agent_http import database_url
from tests.support.consumers import Recorder, Running, consumer_for, eventually, started
from tests.support.second_session import dsn
from tests.support.sessions import terminate
from workflow_delivery import services
from workflow_delivery.admin.target import (
    IDLE_GONE,
    IDLE_LIVE,
    IDLE_UNSEEN,
    agent_activity,
    read_target_state,
    target_url,
    verdicts,
    when,
)
from workflow_delivery.models import IdleWakeTarget
from workflow_delivery.wakeups import ListenerSession, WakeListener

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
LISTENER_NAME = "workflow_delivery wake listener"


def session_of(step: factories.Step) -> str | None:
    state = read_target_state(step.community.id, step.targets[0])
    assert state is not None
    return state.idle_session


def registration(step: factories.Step) -> IdleWakeTarget | None:
    return IdleWakeTarget.objects.filter(community_id=step.community.id).first()


def page(client, step: factories.Step) -> str:
    response = client.get(target_url(step.community.id, step.targets[0]))
    assert response.status_code == 200
    return response.content.decode()


def application_name(pid: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return None if row is None else row[0]


@contextlib.contextmanager
def consumer_process(step: factories.Step) -> Iterator[subprocess.Popen]:
    """``consume_deliveries`` for the step's target, in a process group of its own,
    killed at the end whatever the test did to it."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "consume_deliveries",
            "--community",
            str(step.community.id),
            "--target",
            step.targets[0].hex(),
            "--handler",
            "tests.support.consumer_handlers.do_nothing",
            "--poll-interval",
            "0.2",
        ],
        env={**os.environ, "DATABASE_URL": database_url()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        if process.stderr is not None:
            process.stderr.close()


def registered_by_a_listener(step: factories.Step, process: subprocess.Popen) -> IdleWakeTarget:
    """The consumer's registration, once it made it: naming its listening session."""
    row = eventually(lambda: registration(step), 20)
    assert row is not None, f"no idle registration (consumer exit status {process.poll()})"
    assert application_name(row.pid) == LISTENER_NAME
    return row


def test_a_consumer_killed_with_sigkill_leaves_a_registration_the_page_calls_gone(admin_client):
    step = factories.Step(targets=1)
    with consumer_process(step) as process:
        row = registered_by_a_listener(step, process)
        assert session_of(step) == IDLE_LIVE
        shown = page(admin_client, step)
        assert "registered idle (waiting for a wake-up)" in figure(shown, "agent")
        assert "gone" not in verdict_kinds(shown)

        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        # The registration outlives it; its listener's backend ends once it reads EOF.
        assert eventually(lambda: session_of(step) == IDLE_GONE, 10)
        assert registration(step).pid == row.pid
    shown = page(admin_client, step)
    assert headline(shown)[0] == "nothing"
    assert "gone" in verdict_kinds(shown)
    registered = when(registration(step).registered_at)
    assert (
        f"The consumer that registered idle at {registered} is gone (its session ended "
        "without unregistering): no consumer is waiting: a new delivery waits until a "
        "consumer starts"
    ) in shown.replace("&#x27;", "'")
    assert figure(shown, "agent").startswith(
        f"no: the consumer registered idle at {registered} is gone"
    )

    # A producer that sends no wake-ups leaves the registration: a claimable delivery
    # and the gone consumer make the headline.
    with override_settings(WORKFLOW_DELIVERY_NOTIFY=False):
        committed(step)
    kind, text = headline(page(admin_client, step))
    assert kind == "gone"
    assert text.startswith(
        f"The consumer that registered idle at {registered} is gone (its session ended "
        "without unregistering): no consumer is waiting, yet 1 delivery claimable"
    )


def test_a_cleanly_stopped_consumer_leaves_no_registration(admin_client):
    step = factories.Step(targets=1)
    with consumer_process(step) as process:
        registered_by_a_listener(step, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, process.stderr.read()
    assert registration(step) is None
    assert session_of(step) is None
    shown = page(admin_client, step)
    assert figure(shown, "agent").startswith("no sign of one")
    assert "gone" not in verdict_kinds(shown)


def test_a_registration_follows_the_consumers_listener_to_its_new_session():
    """The session the registration names is the consumer's listener: ended, the
    registration is gone until the consumer listens again and registers anew."""
    step = factories.Step(targets=1)
    consumer = consumer_for(step, Recorder(), poll_interval=0.2)
    with Running(consumer):
        started(consumer)
        first = eventually(lambda: registration(step), 10)
        assert first is not None
        assert first.pid == consumer._listener.session.pid
        assert session_of(step) == IDLE_LIVE
        terminate(first.pid)
        renewed = eventually(
            lambda: (row := registration(step)) is not None and row.pid != first.pid and row, 10
        )
        assert renewed, "the consumer did not register again from its new session"
        assert renewed.pid == consumer._listener.session.pid
        assert application_name(renewed.pid) == LISTENER_NAME
        assert eventually(lambda: session_of(step) == IDLE_LIVE, 5)
    # Stopped cleanly: nothing left.
    assert registration(step) is None


def test_a_registration_without_a_listener_names_the_registering_session():
    step = factories.Step(targets=1)
    services.register_idle(step.community.id, step.targets)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        own = cursor.fetchone()
    row = registration(step)
    assert (row.pid, row.backend_start) == own
    assert session_of(step) == IDLE_LIVE
    connection.close()
    assert eventually(lambda: session_of(step) == IDLE_GONE, 10)


def test_registering_again_renews_the_session_and_the_time():
    step = factories.Step(targets=1)
    with WakeListener() as first:
        services.register_idle(step.community.id, step.targets, session=first.session)
        before = registration(step)
        with WakeListener() as second:
            services.register_idle(step.community.id, step.targets, session=second.session)
            after = registration(step)
            assert (after.pid, after.backend_start) == (
                second.session.pid,
                second.session.backend_start,
            )
            assert after.registered_at > before.registered_at
            assert IdleWakeTarget.objects.filter(community_id=step.community.id).count() == 1


def test_a_session_that_is_not_a_listener_session_is_refused():
    step = factories.Step(targets=1)
    with pytest.raises(Exception, match=r"session: must be a store\.wake\.ListenerSession or None"):
        services.register_idle(step.community.id, step.targets, session=(1, None))
    assert registration(step) is None


@pytest.fixture
def app_role() -> Iterator[tuple[str, str]]:
    """A fresh role made by ``grant_app_role``, logged in as; with the owner's name."""
    owner = connection.settings_dict["USER"]
    with dropped_afterwards("idle") as role:
        call_command("grant_app_role", role, stdout=StringIO())
        with as_role(role):
            yield role, owner


def start_of(pid: int):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid, backend_start FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone()


def test_an_unprivileged_role_tells_its_own_live_and_gone_sessions_apart(app_role):
    role, _ = app_role
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
        assert cursor.fetchone() == (role, False)
    step = factories.Step(targets=1)
    with WakeListener() as listener:
        session = listener.session
        # Another session of the same role: its pid and start are in plain view.
        assert start_of(session.pid) == (session.pid, session.backend_start)
        services.register_idle(step.community.id, step.targets, session=session)
        state = read_target_state(step.community.id, step.targets[0])
        assert state.idle_session == IDLE_LIVE
        assert "waiting for a wake-up" in agent_activity(state)
    assert eventually(lambda: session_of(step) == IDLE_GONE, 10)
    state = read_target_state(step.community.id, step.targets[0])
    assert [verdict.kind for verdict in verdicts(state)] == ["nothing", "gone"]


def test_an_unprivileged_role_cannot_judge_another_roles_session(app_role):
    role, owner = app_role
    step = factories.Step(targets=1)
    other = psycopg.connect(dsn().replace(f"user='{role}'", f"user='{owner}'"))
    try:
        pid, start = other.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()
        assert other.execute("SELECT current_user").fetchone()[0] == owner
        # PostgreSQL shows another role's session's pid to this role, not its start.
        assert start_of(pid) == (pid, None)
        services.register_idle(step.community.id, step.targets, session=ListenerSession(pid, start))
        state = read_target_state(step.community.id, step.targets[0])
        assert state.idle_session == IDLE_UNSEEN
        assert "hidden from this database role" in agent_activity(state)
        assert "gone" not in [verdict.kind for verdict in verdicts(state)]
    finally:
        other.close()


def test_the_table_holds_every_registration_to_a_session():
    """An insert that names no session (as an earlier version's does) records the
    inserting one; a NULL session is refused by PostgreSQL."""
    step = factories.Step(targets=2)
    table = IdleWakeTarget._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (community_id, target_pubkey) VALUES (%s, %s)",
            [step.community.id, step.targets[0]],
        )
        cursor.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        own = cursor.fetchone()
    row = registration(step)
    assert (row.pid, row.backend_start) == own
    for column in ("pid", "backend_start"):
        refused = pytest.raises(IntegrityError, match=f'null value in column "{column}"')
        with refused, transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (community_id, target_pubkey, {column}) "
                "VALUES (%s, %s, NULL)",
                [step.community.id, step.targets[1]],
            )
