"""Database errors by SQLSTATE: a lock or statement timeout is a DeliveryTimeout and never
a lost connection, a session the server ended (idle in transaction too long) is a lost
connection the reaper's loop survives, and any other error is neither."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    connection,
    connections,
    transaction,
)

from tests.support import factories
from tests.support.locks import expire_all, key_of
from tests.support.second_session import other
from workflow_delivery import errors, services
from workflow_delivery.commandline import StopRequest
from workflow_delivery.exceptions import DeliveryTimeout
from workflow_delivery.models import WorkflowAgentDelivery
from workflow_delivery.protocol import Outcome
from workflow_delivery.reaper import Reaper


def test_lock_timeout_is_a_delivery_timeout_not_a_lost_connection(lock_timeout):
    step = factories.Step(targets=1)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    with other() as holder:
        holder.execute(
            "SELECT 1 FROM workflow_agent_deliveries WHERE id = %s FOR UPDATE", [lease.delivery_id]
        )
        with connection.cursor() as c:
            c.execute("SET lock_timeout = '100ms'")
        with pytest.raises(DeliveryTimeout) as caught:
            services.finish_delivery(lease, Outcome.FINISHED)
        holder.rollback()
    assert caught.value.sqlstate == "55P03"
    assert not isinstance(caught.value, OperationalError)
    assert not errors.is_connection_lost(caught.value)
    assert services.finish_delivery(lease, Outcome.FINISHED) is not None


def test_statement_timeout_is_a_delivery_timeout(lock_timeout):
    step = factories.Step(targets=1)
    with other() as executor:
        executor.execute("SELECT pg_advisory_xact_lock(%s)", [key_of(step.community.id)])
        with connection.cursor() as c:
            c.execute("SET statement_timeout = '200ms'")
        try:
            with pytest.raises(DeliveryTimeout) as caught:
                services.commit_deliveries(
                    step.community.id, step.created_at, step.new_deliveries()
                )
        finally:
            with connection.cursor() as c:
                c.execute("RESET statement_timeout")
        executor.rollback()
    assert caught.value.sqlstate == "57014"
    assert not WorkflowAgentDelivery.objects.filter(run=step.run).exists()


def kill_by_idle_timeout() -> None:
    """Leave this thread's session idle in a transaction until the server ends it."""
    with connection.cursor() as c:
        c.execute("SET idle_in_transaction_session_timeout = '100ms'")
        c.execute("BEGIN")
    # A persistent connection (CONN_MAX_AGE=None) with no health check: kept between
    # passes, so the next statement is the first to learn that the server ended the
    # session.
    connection.close_at = None
    connection.health_check_enabled = False
    time.sleep(0.5)


def test_idle_in_transaction_timeout_is_a_lost_connection_the_reaper_loop_survives(worker):
    step = factories.Step(targets=1)
    factories.committed(step)
    expire_all(step)
    worker.call(kill_by_idle_timeout)

    def failing_then_working_loop():
        # The first pass meets the killed session; the loop reconnects and goes on.
        return Reaper(batch_size=10, max_backoff=0.1).loop(
            interval=0.01, stop=StopRequest(), max_sweeps=2
        )

    summary = worker.call(failing_then_working_loop)
    assert (summary.sweeps, summary.failed, summary.reclaimed) == (2, 1, 1)


def test_idle_in_transaction_error_is_classified_as_connection_lost(worker):
    worker.call(kill_by_idle_timeout)

    def next_statement() -> BaseException:
        try:
            with connection.cursor() as c:
                c.execute("SELECT 1")
        except DatabaseError as exc:
            return exc
        pytest.fail("the killed session answered")

    exc = worker.call(next_statement)
    assert errors.sqlstate(exc) == "25P03"
    assert errors.is_connection_lost(exc)


def end_by_idle_session_timeout() -> None:
    """Leave this thread's session idle (no transaction) until the server ends it."""
    with connection.cursor() as c:
        c.execute("SET idle_session_timeout = '100ms'")
    connection.close_at = None
    connection.health_check_enabled = False
    time.sleep(0.5)


def next_statement_error() -> BaseException:
    try:
        with connection.cursor() as c:
            c.execute("SELECT 1")
    except DatabaseError as exc:
        return exc
    pytest.fail("the ended session answered")


def this_threads_connection():
    return connections[DEFAULT_DB_ALIAS]


def test_idle_session_timeout_is_a_lost_connection(worker):
    worker.call(end_by_idle_session_timeout)
    exc = worker.call(next_statement_error)
    assert errors.sqlstate(exc) == "57P05"
    assert errors.is_connection_lost(exc)
    assert errors.is_connection_lost(exc, worker.call(this_threads_connection))


def test_idle_session_timeout_is_a_lost_connection_the_reaper_loop_survives(worker):
    step = factories.Step(targets=1)
    factories.committed(step)
    expire_all(step)
    worker.call(end_by_idle_session_timeout)

    def failing_then_working_loop():
        return Reaper(batch_size=10, max_backoff=0.1).loop(
            interval=0.01, stop=StopRequest(), max_sweeps=2
        )

    summary = worker.call(failing_then_working_loop)
    assert (summary.sweeps, summary.failed, summary.reclaimed) == (2, 1, 1)


@pytest.mark.parametrize("code", ["25P04", "XX000", "22012"])
def test_an_error_that_left_its_connection_closed_is_a_lost_connection(worker, code):
    """Whatever the SQLSTATE: ``transaction_timeout`` (25P04, PostgreSQL 17 and later)
    included, on a server that cannot raise it, and codes no server ends a session with.
    The connection is one the server really ended; the same error on an open one is not
    a lost connection."""
    worker.call(end_by_idle_session_timeout)
    worker.call(next_statement_error)
    ended = worker.call(this_threads_connection)
    error = psycopg.errors.lookup(code)("the server's reason")
    wrapped = DatabaseError("the server's reason")
    wrapped.__cause__ = error
    assert errors.sqlstate(wrapped) == code
    assert errors.is_connection_lost(wrapped, ended)
    assert errors.is_connection_lost(error, ended.connection)
    assert errors.is_connection_lost(wrapped, connection) is (code == "25P04")


def test_other_database_errors_are_neither_lost_nor_timeouts(db):
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as c:
        c.execute("SELECT 1 / 0")
    assert not errors.is_connection_lost(caught.value)
    assert not errors.is_timeout(caught.value)
