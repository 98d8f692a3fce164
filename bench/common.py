"""What every harness under ``bench/`` shares: a private database, Django pointed at
it (in the parent and in each worker process), raw psycopg connections, and
set-based seeding of tenants and deliveries.

API (stable for ``bench/chaos.py`` and friends):

- ``bench_database(prefix="buzz_bench")``: context manager; creates, migrates and
  finally drops a fresh database on the configured server and yields a ``BenchDb``.
- ``setup_django(name, server_side_binding=False)``: in a worker process, point Django
  at database ``name`` (optionally with server-side binding and psycopg's prepared
  statements, as the baselines use).
- ``BenchDb.connect()`` / ``connect(conninfo)``: an autocommit psycopg connection.
- ``create_tenant(conn, label)`` → ``Tenant``; ``seed_deliveries(conn, tenant, count,
  state=…)``; ``truncate_deliveries(conn)``; ``vacuum(conn)``; ``producer_tenant(conn,
  label)`` (an emptied, analysed table for a producer phase); ``cycle_tenant(conn,
  label, pending, history=…, neighbour=…, ids=…)`` (the same for a claim+finish phase).
- ``target_key(i)``: the 32-byte pubkey of target ``i``; ``TARGETS`` = 64. A tenant's
  roster enrolls the keys ``0 … ENROLLED_TARGETS - 1`` (big-endian), every target a
  harness names that way; ``enroll(conn, community, keys)`` enrolls others.
- ``percentile(values, q)``.
- ``api_server(database_url, server="uvicorn", workers=1, env=None, output=None)``:
  context manager; the demo project served by uvicorn (ASGI) or gunicorn (WSGI, gthread
  workers, persistent connections) over that database on a free loopback port; yields
  its base URL and stops the server (and its connections) on exit.
- ``database_url(db)``: a ``DATABASE_URL`` for a ``BenchDb``, for server processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import psycopg
from tqdm import tqdm

from bench import dsn
from bench.dsn import conninfo

ROOT = Path(__file__).resolve().parent.parent
TARGETS = 64
# The keys every tenant enrolls: enough for the largest step a harness commits (1,000).
ENROLLED_TARGETS = 1024
SEED_CHUNK = 50_000
FIRST_SEED_CHUNK = 1_000

PENDING = "pending"
TERMINAL = "finished"
EXPIRED = "expired"


def _environment() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "buzz_project.settings")
    # Benchmarks measure the app, not Django's debug query log.
    os.environ["DEBUG"] = "false"
    os.environ.setdefault("SECRET_KEY", "bench-only-not-a-secret")


def server_settings() -> dict[str, Any]:
    """The configured database entry (DATABASE_URL or the embedded server)."""
    _environment()
    from django.conf import settings

    return dict(settings.DATABASES["default"])


def setup_django(name: str, *, server_side_binding: bool = False) -> None:
    """Point this process's Django at database ``name`` and set it up. Must run
    before anything opens a connection (the app's ``sql`` module does at import)."""
    _environment()
    import django
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = name
    if server_side_binding:
        # Django leaves psycopg's prepared statements off unless told a threshold.
        options = settings.DATABASES["default"].setdefault("OPTIONS", {})
        options.update(server_side_binding=True, prepare_threshold=5)
    django.setup()


def connect(info: dict[str, Any]) -> psycopg.Connection:
    return psycopg.connect(**info, autocommit=True)


def process_cpu(pid: int) -> tuple[int, float]:
    """Process ``pid``'s process group and the CPU seconds (user and system) it has used
    so far, from ``/proc/PID/stat`` (fields 5, 14 and 15 of proc(5), counted after the
    command name, which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class BenchDb:
    name: str
    conninfo: dict[str, Any]
    server_side_binding: bool = False

    def setup_django(self) -> None:
        setup_django(self.name, server_side_binding=self.server_side_binding)

    def connect(self) -> psycopg.Connection:
        return connect(self.conninfo)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def bench_database(
    prefix: str = "buzz_bench", *, quiet: bool = False, server_side_binding: bool = False
) -> Iterator[BenchDb]:
    """Create ``<prefix>_<pid>`` on the configured server, migrate it, and drop it at
    the end, also on Ctrl-C or SIGTERM. No other database is touched."""
    entry = server_settings()
    # BENCH_DB_PREFIX: on a shared server, keep scratch databases under one's own prefix.
    name = f"{os.environ.get('BENCH_DB_PREFIX', prefix)}_{os.getpid()}"
    admin = conninfo(entry, "postgres")
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    with connect(admin) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        setup_django(name, server_side_binding=server_side_binding)
        from django.core.management import call_command

        call_command("migrate", verbosity=0 if quiet else 1, interactive=False)
        yield BenchDb(name, conninfo(entry, name), server_side_binding)
    finally:
        from django.db import connections

        connections.close_all()
        # FORCE ends any connection a killed worker may have left behind.
        with connect(admin) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        signal.signal(signal.SIGTERM, previous)


def target_key(index: int) -> bytes:
    return (index % TARGETS).to_bytes(32, "big")


@dataclass(frozen=True)
class Tenant:
    community_id: uuid.UUID
    workflow_id: uuid.UUID
    run_id: uuid.UUID
    message_id: bytes
    message_created_at: datetime
    definition_id: bytes
    cause_id: bytes


def enroll(conn: psycopg.Connection, community_id: uuid.UUID, keys: list[bytes]) -> None:
    """Enroll ``keys`` as enabled agents of the community (deliveries may go to them)."""
    conn.execute(
        "INSERT INTO community_agents (community_id, pubkey) SELECT %s, k "
        "FROM unnest(%s::bytea[]) AS k ON CONFLICT ON CONSTRAINT wd_agent_key DO NOTHING",
        [community_id, list(keys)],
    )


def create_tenant(conn: psycopg.Connection, label: str) -> Tenant:
    """One community with a workflow, a run and its visible message (kind 9), and the
    targets ``0 … ENROLLED_TARGETS - 1`` in its agent roster."""
    community, workflow, run = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    message = os.urandom(32)
    with conn.transaction():
        conn.execute(
            "INSERT INTO communities (id, host) VALUES (%s, %s)",
            [community, f"{label}-{community.hex[:8]}.bench"],
        )
        enroll(conn, community, [n.to_bytes(32, "big") for n in range(ENROLLED_TARGETS)])
        conn.execute(
            "INSERT INTO workflows (id, community_id, name, owner_pubkey, definition) "
            "VALUES (%s, %s, 'bench', %s, '{}')",
            [workflow, community, os.urandom(32)],
        )
        conn.execute(
            "INSERT INTO workflow_runs (id, community_id, workflow_id) VALUES (%s, %s, %s)",
            [run, community, workflow],
        )
        created_at = conn.execute(
            "INSERT INTO events (id, community_id, created_at, kind, pubkey, content, tags) "
            "VALUES (%s, %s, date_trunc('second', now()), 9, %s, 'bench', '[]') "
            "RETURNING created_at",
            [message, community, os.urandom(32)],
        ).fetchone()[0]
    return Tenant(community, workflow, run, message, created_at, os.urandom(32), os.urandom(32))


_STATE_COLUMNS = {
    PENDING: ("'pending'", "0", "NULL", "NULL", "NULL"),
    TERMINAL: ("'finished'", "1", "NULL", "NULL", "now()"),
    EXPIRED: ("'claimed'", "1", "now() - interval '1 hour'", "now() - interval '2 hours'", "NULL"),
}

# Rows are spread round-robin over the 64 targets; created_at rises with g so the
# oldest-first order is well defined without ties.
_SEED = """
INSERT INTO workflow_agent_deliveries (
    id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
    message_event_id, message_event_created_at, cause_kind, cause_event_id,
    status, lease_generation, lease_until, claimed_at, finished_at, created_at)
SELECT {id}, %(community)s, %(workflow)s, %(run)s,
       %(prefix)s || g, decode(lpad(to_hex(g %% {targets}), 64, '0'), 'hex'), %(definition)s,
       %(message)s, %(message_at)s, 'event', %(cause)s,
       {status}, {generation}, {lease_until}, {claimed_at}, {finished_at}, c.at
  FROM generate_series(%(first)s::int, %(last)s::int) AS g
 CROSS JOIN LATERAL (SELECT now() - interval '1 hour' + g * interval '1 microsecond' AS at) AS c
"""
# Delivery ids as producers choose them: random (version 4), or growing with time as
# protocol.new_delivery_id() makes them (version 7: the milliseconds of created_at,
# its microseconds in the 12 bits after the version, then random bits).
RANDOM_IDS = "random"
ORDERED_IDS = "ordered"
_IDS = {
    RANDOM_IDS: "gen_random_uuid()",
    ORDERED_IDS: (
        "(lpad(to_hex(floor(extract(epoch FROM c.at) * 1000)::bigint), 12, '0') || '7' || "
        "lpad(to_hex(floor(extract(microseconds FROM c.at))::int %% 1000), 3, '0') || '8' || "
        "substr(md5(random()::text || g::text), 1, 15))::uuid"
    ),
}


def seed_deliveries(
    conn: psycopg.Connection,
    tenant: Tenant,
    count: int,
    *,
    state: str = PENDING,
    prefix: str = "seed-",
    progress: bool = True,
    ids: str = RANDOM_IDS,
) -> None:
    """Insert ``count`` deliveries of one state in one transaction, set-based, in
    chunks only so progress can be shown. The fence trigger fires for each row.
    ``ids``: ``RANDOM_IDS`` or ``ORDERED_IDS`` (see ``_IDS``)."""
    status, generation, lease_until, claimed_at, finished_at = _STATE_COLUMNS[state]
    statement = _SEED.format(
        id=_IDS[ids],
        targets=TARGETS,
        status=status,
        generation=generation,
        lease_until=lease_until,
        claimed_at=claimed_at,
        finished_at=finished_at,
    )
    params = {
        "community": tenant.community_id,
        "workflow": tenant.workflow_id,
        "run": tenant.run_id,
        "prefix": prefix,
        "definition": tenant.definition_id,
        "message": tenant.message_id,
        "message_at": tenant.message_created_at,
        "cause": tenant.cause_id,
    }
    bar = tqdm(
        total=count,
        desc=f"seed {state}",
        unit="row",
        unit_scale=True,
        disable=not progress,
        leave=False,
    )
    # The one-message row trigger probes the step once per row. Planned from
    # statistics that have not seen this community (or an emptied table), every index
    # looks as cheap as the next and the probe may read the whole community through
    # (community_id, id): quadratic in a large seed. An ANALYZE after the first rows
    # (inside the transaction it sees them) gives the planner the community
    # (docs/explanation/limits.md).
    bounds = [(0, min(count, FIRST_SEED_CHUNK))]
    bounds += [
        (first, min(first + SEED_CHUNK, count)) for first in range(bounds[0][1], count, SEED_CHUNK)
    ]
    with bar, conn.transaction():
        for first, end in bounds:
            conn.execute(statement, {**params, "first": first, "last": end - 1})
            bar.update(end - first)
            if first == 0 and end < count:
                conn.execute("ANALYZE workflow_agent_deliveries")


def truncate_deliveries(conn: psycopg.Connection) -> None:
    conn.execute(
        "TRUNCATE workflow_delivery_agent_turns, workflow_delivery_timeline,"
        " workflow_agent_deliveries"
    )


# Terminal rows a producer phase starts beside: enough for ANALYZE to know the table.
PRODUCER_HISTORY = 2_000


def producer_tenant(conn: psycopg.Connection, label: str) -> Tenant:
    """An emptied table holding one new tenant, with ``PRODUCER_HISTORY`` settled rows
    of its own and fresh statistics, for a phase that commits new steps.

    A table that is empty and never analysed is planned as a few pages: every index
    whose first column is ``community_id`` then costs the same as the (community_id,
    id) key, and the plan a session caches for a foreign-key check on its first
    statement may read the whole community per row for as long as the session lives
    (until autovacuum's ANALYZE invalidates it, up to a minute later). Whichever side
    of a phase wrote first would pay it; a production table is analysed."""
    truncate_deliveries(conn)
    tenant = create_tenant(conn, label)
    seed_deliveries(
        conn, tenant, PRODUCER_HISTORY, state=TERMINAL, prefix="settled-", progress=False
    )
    vacuum(conn)
    return tenant


def cycle_tenant(
    conn: psycopg.Connection,
    label: str,
    pending: int,
    *,
    history: int = 0,
    neighbour: int = 0,
    ids: str = RANDOM_IDS,
    pending_progress: bool = True,
) -> Tenant:
    """An emptied table holding one new tenant with ``pending`` rows to claim, for a
    claim+finish phase: behind ``history`` terminal rows of the same targets, beside
    a ``neighbour`` community holding that many pending rows, its delivery ids
    ``ids``; vacuumed, analysed and checkpointed (``vacuum``)."""
    truncate_deliveries(conn)
    tenant = create_tenant(conn, label)
    if history:
        seed_deliveries(conn, tenant, history, state=TERMINAL, prefix="old-", ids=ids)
    if neighbour:
        other = create_tenant(conn, "busy")
        seed_deliveries(conn, other, neighbour, state=PENDING)
    seed_deliveries(conn, tenant, pending, state=PENDING, ids=ids, progress=pending_progress)
    vacuum(conn)
    return tenant


def vacuum(conn: psycopg.Connection) -> None:
    """Vacuum and analyse the two tables, then checkpoint, so a phase starts settled.

    Seeding 1,000,000 rows writes more WAL than ``max_wal_size`` asks a checkpoint
    for: without one here, the checkpoints the seed set off run on into the measured
    window (seen in the server's log: one after another for two minutes), and the
    phase after a large seed pays for them while the one after a small seed does not.
    ``CHECKPOINT`` needs a superuser or ``pg_checkpoint``; without either the phase
    goes on unsettled, and says so."""
    conn.execute("VACUUM ANALYZE workflow_agent_deliveries")
    conn.execute("VACUUM ANALYZE workflow_delivery_timeline")
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege as error:
        print(f"bench: no checkpoint before the phase ({error})", file=sys.stderr)


_UNSET = object()


def use_setting(name: str, value: Any) -> None:
    """Set a Django setting in this process the way ``override_settings`` does, so the
    app's remembered copy (``workflow_delivery.conf.app_settings``) is dropped too: a
    bare ``settings.X = value`` after the app has read X changes nothing it does.
    Setting the value it already has does nothing, so a loop may call this before
    every unit of work and pay for a change only at a turn's boundary."""
    from django.conf import settings
    from django.core.signals import setting_changed

    if getattr(settings, name, _UNSET) == value:
        return
    setattr(settings, name, value)
    setting_changed.send(sender=type(settings), setting=name, value=value, enter=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def database_url(db: BenchDb) -> str:
    """A ``DATABASE_URL`` for ``db``, for server processes (see ``bench.dsn``)."""
    return dsn.database_url(db.name, db.conninfo)


def _listening_socket() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it from the listener (Linux), whichever server
    # accepts them: no response waits on Nagle's algorithm for the client's delayed ACK.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    return listener


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
            probe.sendall(b"GET /agents/v1/openapi.json HTTP/1.0\r\nHost: probe\r\n\r\n")
            return probe.recv(16).split(b" ")[1:2] == [b"200"]
    except OSError:
        return False


SERVERS = ("uvicorn", "gunicorn")


def _server_command(server: str, fd: int, port: int, workers: int) -> list[str]:
    if server == "uvicorn":
        # --fd, the listener bound here with TCP_NODELAY: uvicorn's own listener for
        # --workers N (as for --fd) is made with proto 0, which asyncio takes for "not
        # TCP" and leaves Nagle's algorithm on, so every response's body, written after
        # its headers, waits for the client's delayed ACK (~40 ms; Kludex/uvicorn#3149).
        command = [sys.executable, "-m", "uvicorn", "buzz_project.asgi:application"]
        command += ["--fd", str(fd), "--workers", str(workers)]
        command += ["--log-level", "warning", "--no-access-log"]
        return [*command, "--timeout-graceful-shutdown", "3"]
    if server == "gunicorn":
        command = [sys.executable, "-m", "gunicorn", "buzz_project.wsgi:application"]
        command += ["--bind", f"fd://{fd}", "--workers", str(workers)]
        command += ["--worker-class", "gthread", "--threads", "4"]
        return [*command, "--log-level", "warning", "--graceful-timeout", "3"]
    raise ValueError(f"server must be one of {SERVERS}, not {server!r}")


@contextmanager
def api_server(
    url: str,
    *,
    server: str = "uvicorn",
    workers: int = 1,
    env: dict[str, str] | None = None,
    output: IO[bytes] | None = None,
    started: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """The demo project under ``server`` over database ``url`` on a free loopback
    port (both servers inherit the socket bound here, TCP_NODELAY set); yields
    ``http://127.0.0.1:PORT``. SIGTERM at the end, SIGKILL if it lingers. Under
    gunicorn each worker thread keeps its connection (``conn_max_age``); under uvicorn
    the project's ``asgi.py`` runs each request's sync code on one of a few long-lived
    threads, which keep theirs. ``output``: a file for the server's output (this
    process's own by default); ``started``: a list the server's process is appended to
    (its pid, for its memory and CPU)."""
    listener = _listening_socket()
    port = listener.getsockname()[1]
    if server == "gunicorn":
        url += ("&" if "?" in url else "?") + "conn_max_age=60"
    environment = {
        **os.environ,
        "DATABASE_URL": url,
        "DEBUG": "false",
        "SECRET_KEY": os.environ.get("SECRET_KEY", "bench-only-not-a-secret"),
        "ALLOWED_HOSTS": "*",
        # Plain HTTP on loopback: the production default would redirect to HTTPS.
        "SECURE_SSL_REDIRECT": "false",
        **(env or {}),
    }
    inherited = [listener.fileno()]
    process = subprocess.Popen(
        _server_command(server, listener.fileno(), port, workers),
        cwd=ROOT,
        env=environment,
        pass_fds=inherited,
        start_new_session=True,
        stdout=output,
        stderr=None if output is None else subprocess.STDOUT,
    )
    listener.close()
    if started is not None:
        started.append(process)
    try:
        deadline = time.monotonic() + 30
        while not _answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{server} did not start (exit status {process.poll()})")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
