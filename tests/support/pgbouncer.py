"""A PgBouncer in transaction pooling mode in front of the test database's server.

Started for one test on a free port from a scratch folder, run as user ``postgres``
when this process is root (PgBouncer refuses to run as root), and stopped after.
A missing ``pgbouncer`` binary is a failure, never a skip.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def real_server(settings: dict[str, Any]) -> dict[str, Any]:
    """The DATABASES entry of the PostgreSQL server itself.

    The suite's own connection may already go through a pooler (the matrix's pgbouncer
    cell); that cell names the server behind it in WD_TEST_SERVER (host:port).
    """
    behind = os.environ.get("WD_TEST_SERVER", "")
    if not behind:
        return dict(settings)
    host, _, port = behind.rpartition(":")
    return {**settings, "HOST": host, "PORT": port}


def _system_user(server: dict[str, Any]) -> str:
    """Who runs PgBouncer when this process is root: the owner of the server's socket
    folder (the embedded server's own user, the only one let in), else postgres."""
    host = server.get("HOST") or ""
    if host.startswith("/"):
        owner = pwd.getpwuid(Path(host).stat().st_uid).pw_name
        if owner != "root":
            return owner
    return "postgres"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(server: dict[str, Any], folder: Path, port: int, pool_size: int) -> str:
    host = server.get("HOST") or "127.0.0.1"
    target = f"host={host} port={server.get('PORT') or 5432}"
    return f"""
[databases]
* = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "users.txt"}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 50
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
logfile = {folder / "pgbouncer.log"}
pidfile = {folder / "pgbouncer.pid"}
"""


@contextmanager
def pgbouncer(server: dict[str, Any], *, pool_size: int) -> Iterator[dict[str, Any]]:
    """Yield a copy of ``server`` (a DATABASES entry) that connects through PgBouncer."""
    server = real_server(server)
    if not os.access(PGBOUNCER, os.X_OK):
        pytest.fail(f"{PGBOUNCER} is missing: apt-get install pgbouncer (.ci/run does)")
    folder = Path(tempfile.mkdtemp(prefix="wd-pgbouncer-"))
    port = _free_port()
    user = server.get("USER") or "postgres"
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(_config(server, folder, port, pool_size))
    command = [PGBOUNCER, "-q", str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        runner = _system_user(server)
        shutil.chown(folder, runner)
        folder.chmod(0o755)
        command = ["runuser", "-u", runner, "--", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (folder / "pgbouncer.log").read_text(errors="replace")
                    output = (
                        process.stdout.read().decode(errors="replace") if process.stdout else ""
                    )
                    pytest.fail(f"pgbouncer did not start: {output} {log}"[-2000:])
                time.sleep(0.1)
        yield {**server, "HOST": "127.0.0.1", "PORT": str(port)}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)
