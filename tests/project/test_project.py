"""The host project: settings from the environment, clear errors, checks, migrations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.db.utils import ConnectionHandler
from django.test import override_settings

from workflow_delivery import checks

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "DATABASE_CONNECT_TIMEOUT": "3", **env}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DATABASE_URL": "mysql://u@127.0.0.1/db"}, "DATABASE_URL must be a PostgreSQL URL"),
        ({"DATABASE_URL": "postgres://root@127.0.0.1:5432"}, "DATABASE_URL names no database"),
        ({"DEBUG": "maybe"}, "DEBUG must be true or false"),
        ({"DEBUG": "false", "SECRET_KEY": ""}, "SECRET_KEY must be set"),
        ({"WORKFLOW_DELIVERY_MAX_LEASE_SECONDS": "lots"}, "WORKFLOW_DELIVERY_MAX_LEASE_SECONDS"),
        (
            {"DATABASE_URL": "postgres://root@127.0.0.1:5441,/db"},
            "DATABASE_URL is malformed: host '' of its host list",
        ),
        (
            {"DATABASE_URL": "postgres://root@127.0.0.1:5441,127.0.0.1:x/db"},
            "DATABASE_URL is malformed: host '127.0.0.1' has port 'x'",
        ),
        (
            {"DATABASE_URL": "postgres://root@a:1,b:2/db?target_session_attrs=writable"},
            "DATABASE_URL's target_session_attrs must be one of any, read-write",
        ),
    ],
)
def test_bad_configuration_is_one_clear_line(env, expected):
    result = manage("check", **{"DATABASE_URL": os.environ.get("DATABASE_URL", ""), **env})
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "url",
    [
        "postgres://root@127.0.0.1:1/unreachable",
        # MariaDB's port: a server that is not PostgreSQL.
        "postgres://root@127.0.0.1:3306/test",
    ],
)
def test_unusable_database_is_a_clear_error(url):
    result = manage("migrate", DATABASE_URL=url)
    assert result.returncode != 0
    assert result.stderr.startswith("database error: cannot use the database")
    assert "DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_e001_reports_a_database_that_is_not_postgresql(monkeypatch):
    sqlite = ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )
    monkeypatch.setattr(checks, "connections", sqlite)
    errors = checks.check_postgresql()
    assert [error.id for error in errors] == ["workflow_delivery.E001"]
    assert errors[0].msg == (
        "workflow_delivery needs PostgreSQL 14 or newer: database 'default' uses the "
        "'sqlite' backend."
    )


def test_e001_is_silent_on_postgresql():
    assert checks.check_postgresql() == []


def test_e001_reports_a_server_older_than_the_oldest_tested(db, monkeypatch):
    number = connection.pg_version
    found = f"{number // 10000}.{number % 10000}"
    # The real server, judged against a minimum above it.
    monkeypatch.setattr(checks, "MINIMUM_POSTGRESQL", (number // 10000 + 1,))
    errors = checks.check_postgresql()
    assert [error.id for error in errors] == ["workflow_delivery.E001"]
    assert errors[0].msg == (
        f"workflow_delivery needs PostgreSQL {number // 10000 + 1} or newer: database "
        f"'default' is PostgreSQL {found}."
    )


def test_an_old_server_fails_the_check_command_in_one_line(db, monkeypatch):
    # The suite's own server, judged against a minimum above it.
    monkeypatch.setattr(checks, "MINIMUM_POSTGRESQL", (99,))
    with pytest.raises(SystemCheckError) as failure:
        call_command("check")
    lines = [line for line in str(failure.value).splitlines() if "E001" in line]
    assert len(lines) == 1
    assert "needs PostgreSQL 99 or newer: database 'default' is PostgreSQL" in lines[0]


@override_settings(
    WORKFLOW_DELIVERY_MAX_LEASE_SECONDS=0, WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS=-1
)
def test_settings_checks_report_unusable_values():
    ids = [error.id for error in checks.check_settings()]
    assert ids == ["workflow_delivery.E002", "workflow_delivery.E004"]


@override_settings(
    WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS=120, WORKFLOW_DELIVERY_MAX_LEASE_SECONDS=60
)
def test_settings_check_reports_a_default_above_the_maximum():
    errors = checks.check_settings()
    assert [error.id for error in errors] == ["workflow_delivery.E003"]
    assert errors[0].msg == checks.E003_MSG.format(default=120, maximum=60)


def _wd_objects() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT (SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'wd\\_%%')
                 + (SELECT count(*) FROM pg_proc WHERE proname IN
                       ('community_write_allowed', 'wd_community_deletion_key'))
                 + (SELECT count(*) FROM pg_class WHERE relname = 'workflow_agent_deliveries')
            """
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_migrations_are_reversible():
    installed = _wd_objects()
    assert installed >= 8
    try:
        call_command("migrate", "workflow_delivery", "zero", verbosity=0)
        assert _wd_objects() == 0
    finally:
        call_command("migrate", "workflow_delivery", verbosity=0)
    assert _wd_objects() == installed


def test_no_model_change_lacks_a_migration(db):
    call_command("makemigrations", "workflow_delivery", check=True, dry_run=True, verbosity=0)


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("WORKFLOW_DELIVERY_MAX_ATTEMPTS", 0, "workflow_delivery.E008"),
        ("WORKFLOW_DELIVERY_MAX_ATTEMPTS", "20", "workflow_delivery.E008"),
        ("WORKFLOW_DELIVERY_RETENTION", "a month", "workflow_delivery.E009"),
        ("WORKFLOW_DELIVERY_PRUNE_BATCH_SIZE", 0, "workflow_delivery.E002"),
        ("WORKFLOW_DELIVERY_REAP_YIELD_RATIO", -1, "workflow_delivery.E005"),
        ("WORKFLOW_DELIVERY_PRUNE_YIELD_RATIO", 101, "workflow_delivery.E005"),
        ("WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS", 0, "workflow_delivery.E010"),
        ("WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS", float("inf"), "workflow_delivery.E010"),
        ("WORKFLOW_DELIVERY_API_WAIT_SWEEP_SECONDS", -1.0, "workflow_delivery.E010"),
    ],
)
def test_settings_checks_report_a_bad_cap_retention_or_prune_batch(setting, value, expected):
    with override_settings(**{setting: value}):
        errors = checks.check_settings()
        assert [error.id for error in errors] == [expected]
    if expected == "workflow_delivery.E005":
        name = setting.removeprefix("WORKFLOW_DELIVERY_")
        assert errors[0].msg == checks.E005_MSG.format(name=name, value=value)
    if expected == "workflow_delivery.E010":
        name = setting.removeprefix("WORKFLOW_DELIVERY_")
        assert errors[0].msg == checks.E010_MSG.format(name=name, value=value)


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=None, WORKFLOW_DELIVERY_RETENTION="0s")
def test_no_cap_and_a_zero_retention_are_valid():
    assert checks.check_settings() == []


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS", "1e3", "1000.0"),
        ("WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS", " 2.5 ", "2.5"),
        ("WORKFLOW_DELIVERY_REAP_YIELD_RATIO", "3", "3.0"),
        ("WORKFLOW_DELIVERY_REAP_BATCH_SIZE", "250", "250"),
        ("WORKFLOW_DELIVERY_PREPARED_STATEMENTS", "off", "False"),
    ],
)
def test_every_app_setting_is_read_from_the_environment_as_its_type(name, raw, expected):
    script = f"from django.conf import settings; print(repr(settings.{name}))"
    result = manage("shell", "-c", script, **{name: raw})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected


def test_the_project_reads_every_setting_the_app_defines():
    from django.conf import settings

    from workflow_delivery.conf import DEFAULTS

    script = "from django.conf import settings; print(settings.WORKFLOW_DELIVERY_{})"
    for name, default in DEFAULTS.items():
        assert getattr(settings, f"WORKFLOW_DELIVERY_{name}") == default
    result = manage("shell", "-c", script.format("REAP_BATCH_SIZE"))
    assert result.stdout.strip().splitlines()[-1] == str(DEFAULTS["REAP_BATCH_SIZE"])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("1e999", "must be a finite number"),
        ("nan", "must be a number"),
        ("inf", "must be a number"),
        ("5s", "must be a number"),
        ("0x10", "must be a number"),
    ],
)
def test_a_malformed_number_names_its_variable(raw, message):
    name = "WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS"
    result = manage("check", **{name: raw})
    assert result.returncode != 0
    assert f"{name} {message}, got {raw!r}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.psycopg3  # Django's pool is psycopg 3's
def test_database_pool_size_gives_the_project_a_pool_that_serves():
    script = (
        "from django.conf import settings; from django.db import connection; "
        "print(settings.DATABASES['default']['OPTIONS']['pool']); "
        "cursor = connection.cursor(); cursor.execute('SELECT 1'); "
        "print(cursor.fetchone()[0] == 1); "
        "print(type(connection.pool).__name__); connection.close_pool()"
    )
    result = manage("shell", "-c", script, DATABASE_POOL_SIZE="3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-3:] == [
        "{'min_size': 1, 'max_size': 3}",
        "True",
        "ConnectionPool",
    ]
    refused = manage("check", DATABASE_POOL_SIZE="-1")
    assert refused.returncode != 0
    assert "DATABASE_POOL_SIZE must be 0 or more, got -1." in refused.stderr


def test_a_whole_number_setting_refuses_a_fraction():
    result = manage("check", WORKFLOW_DELIVERY_REAP_BATCH_SIZE="2.5")
    assert "WORKFLOW_DELIVERY_REAP_BATCH_SIZE must be a whole number, got '2.5'" in result.stderr


def test_production_settings_pass_the_deploy_check():
    production = {
        "DEBUG": "false",
        "SECRET_KEY": "k" + "".join(chr(33 + i % 90) for i in range(64)),
        "ALLOWED_HOSTS": "deliveries.example",
    }
    result = manage("check", "--deploy", "--fail-level", "WARNING", **production)
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_debug_is_off_unless_the_environment_turns_it_on():
    # The project's own settings module (not the test run's), with DEBUG unset.
    unset = {"DEBUG", "DJANGO_SETTINGS_MODULE"}
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**environment, "SECRET_KEY": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is false" in result.stderr


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        ("", "owner secret 127.0.0.1 5433 buzzdb"),
        ("buzz_app", "buzz_app app-secret 127.0.0.1 5433 buzzdb"),
    ],
)
def test_app_database_role_changes_the_user_and_nothing_else(role, expected):
    # scripts/run migrates with APP_DATABASE_ROLE empty and serves with it set.
    show = (
        "from django.conf import settings; d = settings.DATABASES['default']; "
        "print(d['USER'], d['PASSWORD'], d['HOST'], d['PORT'], d['NAME'])"
    )
    result = manage(
        "shell",
        "-c",
        show,
        DATABASE_URL="postgres://owner:secret@127.0.0.1:5433/buzzdb",
        APP_DATABASE_ROLE=role,
        APP_DATABASE_PASSWORD="app-secret",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("opted_out", [False, True])
def test_the_browser_and_pooler_tests_are_left_out_only_on_request_and_said_so(opted_out):
    """``scripts/test --without-system-packages`` sets the variable: the tests that need
    Debian's chromium or pgbouncer are deselected and the run's end names them."""
    environment = {k: v for k, v in os.environ.items() if k != "BUZZ_TESTS_WITHOUT_SYSTEM_PACKAGES"}
    if opted_out:
        environment["BUZZ_TESTS_WITHOUT_SYSTEM_PACKAGES"] = "1"
    modules = ["tests/admin/test_browser.py", "tests/store/test_pooler.py"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", *modules],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    if opted_out:
        assert collected == []
        assert "browser and pooler tests NOT RUN" in result.stdout
    else:
        assert {line.split("::")[0] for line in collected} == set(modules)
        assert "NOT RUN" not in result.stdout


def test_a_multi_host_url_gives_each_host_its_own_port():
    show = (
        "from django.conf import settings; d = settings.DATABASES['default']; "
        "print(d['HOST'], d['PORT'], d['OPTIONS']['target_session_attrs'])"
    )
    url = "postgres://root@10.0.0.1:5441,[::1],db.example:5443/buzz?target_session_attrs=read-write"
    result = manage("shell", "-v", "0", "-c", show, DATABASE_URL=url, DEBUG="true")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["10.0.0.1,::1,db.example", "5441,5432,5443", "read-write"]


@pytest.mark.psycopg3  # the wake-up listener is a psycopg 3 session
def test_a_multi_host_url_reaches_the_host_that_answers():
    # The first host refuses connections: libpq tries the next one, as it does when a
    # failed primary is first in the list.
    # The test's server is second: by TCP, or by its socket directory (percent-encoded,
    # the embedded server's).
    server = connection.settings_dict
    second = quote(server["HOST"] or "127.0.0.1", safe="")
    if server["PORT"]:
        second += f":{server['PORT']}"
    url = (
        f"postgres://{server['USER']}@127.0.0.1:1,{second}/"
        f"{server['NAME']}?target_session_attrs=read-write"
    )
    show = (
        "from django.db import connection; from workflow_delivery.wakeups import WakeListener\n"
        "with connection.cursor() as c:\n"
        "    c.execute('SELECT current_database(), pg_is_in_recovery()'); print(*c.fetchone())\n"
        "with WakeListener() as listener: print(listener.connected)"
    )
    result = manage("shell", "-v", "0", "-c", show, DATABASE_URL=url, DEBUG="true")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [server["NAME"], "False", "True"]
