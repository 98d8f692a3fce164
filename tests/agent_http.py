"""Helpers of the agent API tests: keys, signed requests through Django's test client,
and a real uvicorn server over the test database."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.test import Client

from workflow_delivery.api import nip98

ROOT = Path(__file__).resolve().parent.parent
MOUNT = "/agents/"


def secret() -> bytes:
    return os.urandom(32)


def pubkey(secret_key: bytes) -> bytes:
    return nip98.public_key(secret_key)


def signed(
    client: Client,
    method: str,
    path: str,
    document: object = None,
    *,
    host: str,
    secret_key: bytes,
    raw: bytes | None = None,
    query: str = "",
    sign_url: str | None = None,
    sign_method: str | None = None,
    sign_body: bytes | None = None,
    authorization: str | None = None,
    **sign_options,
):
    """One request to the API through the test client, signed for exactly what it sends
    unless a ``sign_*`` override signs something else."""
    body = raw if raw is not None else b"" if document is None else json.dumps(document).encode()
    full_path = MOUNT + path + (f"?{query}" if query else "")
    url = f"http://{host}{full_path}"
    if authorization is None:
        authorization = nip98.sign_request(
            secret_key,
            url=sign_url if sign_url is not None else url,
            method=sign_method if sign_method is not None else method,
            body=sign_body if sign_body is not None else body,
            **sign_options,
        )
    return client.generic(
        method,
        full_path,
        data=body,
        content_type="application/json",
        HTTP_HOST=host,
        HTTP_AUTHORIZATION=authorization,
    )


def _free_socket() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    return listener


def _database_url() -> str:
    """The test database (as pytest-django created it) for a server process."""
    db = settings.DATABASES["default"]
    base = urlsplit(os.environ.get("DATABASE_URL", ""))
    if base.scheme:
        return urlunsplit(base._replace(path="/" + db["NAME"]))
    user = db.get("USER") or ""
    host = f"{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"
    return f"postgres://{user}@{host}/{db['NAME']}"


@contextmanager
def uvicorn_server(workers: int = 1, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A uvicorn process serving the demo project (ASGI) over the test database, on a
    socket bound here so the port is known before it starts; yields its base URL
    (``http://127.0.0.1:PORT``). Always stopped, with its connections, on exit."""
    listener = _free_socket()
    port = listener.getsockname()[1]
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(),
        "DEBUG": "false",
        "SECRET_KEY": "agent-api-tests-not-a-secret",
        "ALLOWED_HOSTS": "*",
        **(extra_env or {}),
    }
    command = [sys.executable, "-m", "uvicorn", "buzz_project.asgi:application"]
    command += ["--fd", str(listener.fileno()), "--log-level", "warning", "--no-access-log"]
    command += ["--workers", str(workers), "--timeout-graceful-shutdown", "3"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, pass_fds=[listener.fileno()], start_new_session=True
    )
    listener.close()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
                    probe.sendall(b"GET /agents/v1/openapi.json HTTP/1.0\r\nHost: x\r\n\r\n")
                    if probe.recv(12).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start (exit {process.poll()})")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
