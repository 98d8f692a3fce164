"""``scripts/run``, the README's main job, stops what it started on SIGTERM: the admin
server with its reaper and HTTP agents, and the scripted ACP agent's runtime, each
stopped cleanly by one SIGTERM of its own, and then the script ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from django.db import connection

from tests.support.agent_http import database_url

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.psycopg3, pytest.mark.django_db(transaction=True)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``: proc(5)'s fourth field of
    ``stat``, counted after the command name)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def role():
    """The app role the script serves as, this test's alone, dropped afterwards."""
    name = f"h10_run_{uuid.uuid4().hex[:8]}"
    yield name
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [name])
        if cursor.fetchone():
            cursor.execute(f"DROP OWNED BY {name}")
            cursor.execute(f"DROP ROLE {name}")


def test_a_sigterm_stops_every_process_the_script_started_and_the_script(role):
    environment = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "APP_DATABASE_ROLE": role,
        "APP_DATABASE_PASSWORD": "run-script-test",
        "ADDRESS": f"127.0.0.1:{_free_port()}",
    }
    script = subprocess.Popen(
        [str(ROOT / "scripts" / "run")],
        cwd=ROOT,
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(script.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("acp.runtime agent" in line and "started" in line for line in lines):
            assert script.poll() is None, "".join(lines[-40:])
            assert time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.2)
        started = _children(script.pid)
        assert len(started) == 2, (started, "".join(lines[-40:]))
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if script.poll() is None:
            # The serving processes run in process groups of their own.
            for pid in _children(script.pid):
                os.killpg(pid, signal.SIGKILL)
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    reader.join(10)
    output = "".join(lines)
    assert not [pid for pid in started if _alive(pid)], output[-2000:]
    # Each stopped on its first signal: a second would have made it exit at once.
    assert "exiting at once" not in output
    assert "admin server stopped; reaper stopped by SIGTERM" in output
    assert "HTTP agents stopped" in output
    assert "stopped by SIGTERM: claimed=" in output
