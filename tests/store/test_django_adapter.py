"""What ``store.django_adapter`` assumes of Django's connection holds on the installed
Django: every attribute it names is there, and each of its functions behaves as the
store relies on (the nox matrix runs this on Django 5.2, 6.0 and 6.1)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.core.exceptions import SynchronousOnlyOperation
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    connection,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError

from workflow_delivery.store import django_adapter as django

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_attribute_the_adapter_names_is_there():
    connection.ensure_connection()
    missing = [name for name in django.ATTRIBUTES if not hasattr(connection, name)]
    assert missing == []


def test_raw_is_the_drivers_connection_and_none_while_closed():
    connection.close()
    assert django.raw(connection) is None
    raw = django.connect(connection)
    assert raw is django.raw(connection) is not None
    # The driver's own (psycopg's or psycopg2's), not Django's wrapper of it.
    assert type(raw).__module__.startswith("psycopg") and not raw.closed
    # Open already: the same connection.
    assert django.connect(connection) is raw


def test_connect_is_refused_inside_an_event_loop():
    async def inside() -> None:
        django.connect(connection)

    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(inside())


def test_the_health_check_is_pending_once_a_request_ends_and_made_by_connect(settings):
    assert connection.settings_dict["CONN_HEALTH_CHECKS"]
    django.connect(connection)
    assert not django.health_check_pending(connection)
    # What Django does at the end of each request.
    connection.close_if_unusable_or_obsolete()
    assert django.health_check_pending(connection)
    raw = django.connect(connection)
    assert not django.health_check_pending(connection)
    assert django.raw(connection) is raw
    connection.close_if_unusable_or_obsolete()
    django.health_check_made(connection)
    assert not django.health_check_pending(connection)


def test_in_transaction_is_inside_atomic():
    assert not django.in_transaction(connection)
    with transaction.atomic():
        assert django.in_transaction(connection)
    assert not django.in_transaction(connection)


def test_a_broken_transaction_is_refused_before_a_statement():
    with transaction.atomic():
        django.check_statement(connection)
        transaction.set_rollback(True)
        with pytest.raises(TransactionManagementError):
            django.check_statement(connection)
        transaction.set_rollback(False)


def test_another_threads_connection_is_refused_unless_shared():
    # This thread's wrapper itself: ``connection`` resolves to each thread's own.
    ours = connections[DEFAULT_DB_ALIAS]
    django.connect(ours)
    errors: list[BaseException] = []

    def use() -> None:
        for check in (django.check_thread, django.check_statement):
            try:
                check(ours)
            except DatabaseError as exc:
                errors.append(exc)

    assert not django.shared_between_threads(connection)
    thread = threading.Thread(target=use)
    thread.start()
    thread.join(30)
    assert len(errors) == 2 and all("thread" in str(error) for error in errors)
    connection.inc_thread_sharing()
    try:
        assert django.shared_between_threads(connection)
        errors.clear()
        thread = threading.Thread(target=use)
        thread.start()
        thread.join(30)
        assert errors == []
    finally:
        connection.dec_thread_sharing()


def test_the_drivers_errors_are_raised_as_djangos():
    with pytest.raises(IntegrityError), django.as_django_errors(connection):
        raise connection.Database.IntegrityError("a driver's error")


def test_an_execute_wrapper_kept_for_good_comes_first_and_once():
    seen: list[str] = []

    def ours(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    def theirs(execute, sql, params, many, context):
        return execute(sql, params, many, context)

    try:
        with connection.execute_wrapper(theirs):
            django.keep_execute_wrapper(connection, ours)
            django.keep_execute_wrapper(connection, ours)
            installed = connection.execute_wrappers
            assert installed[0] is ours and installed[-1] is theirs and installed.count(ours) == 1
        # The block popped its own, not ours.
        assert connection.execute_wrappers[0] is ours and theirs not in connection.execute_wrappers
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        assert seen == ["SELECT 1"]
    finally:
        connection.execute_wrappers.remove(ours)


def test_pooled_reads_the_pool_option():
    assert django.pooled(connection) == bool(connection.settings_dict["OPTIONS"].get("pool"))
