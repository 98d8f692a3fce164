"""The demo project under uvicorn (``workflow_delivery.api.asgi``): the server's
requests run on a few long-lived threads, so they reuse their PostgreSQL sessions,
leave none in a transaction, and replace one that broke before a request uses it.

The server's sessions are told apart by ``PGAPPNAME``, which libpq reads for every
connection the server opens (the wake listener names its own).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import select
import socket
import threading
import time
import uuid

import pytest
from django.core import signals
from django.db import connection

from tests.api.helpers import enrolled_secret
from tests.support import factories
from tests.support.agent_http import pubkey, secret, uvicorn_server
from workflow_delivery.api import nip98
from workflow_delivery.api.asgi import POOLED_THREADS, PooledThreadsHandler
from workflow_delivery.client import AgentClient
from workflow_delivery.models import AgentRequestReplay, IdleWakeTarget
from workflow_delivery.protocol import LeaseLost, Outcome, Settled
from workflow_delivery.services import commit_deliveries

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.psycopg3,
    pytest.mark.skipif(not POOLED_THREADS, reason="asgiref before 3.13: a thread per request"),
]

APP_NAME = f"wd-asgi-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    # One worker process and one thread: every request of the test is served on
    # the same thread, so it must find the same session there.
    env = {"PGAPPNAME": APP_NAME, "ASGI_THREADS": "1"}
    with uvicorn_server(extra_env=env) as url:
        yield url


def base_url(server: str) -> str:
    return f"http://localhost:{server.rsplit(':', 1)[1]}/agents/"


def server_sessions() -> list[tuple[int, str]]:
    """(pid, state) of the server's own database sessions, by pid."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, state FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database() ORDER BY pid",
            [APP_NAME],
        )
        return cursor.fetchall()


def test_sequential_requests_are_served_on_one_session(server):
    key = enrolled_secret(factories.community("localhost"))
    seen = []
    with AgentClient(base_url(server), key) as agent:
        for _ in range(5):
            assert agent.claim() is None
            seen.append(server_sessions())
    # Not a session per request, none closed at a request's end, none left behind.
    assert len(seen[0]) == 1
    assert seen == [seen[0]] * 5
    assert seen[0][0][1] == "idle"


def test_a_refused_request_rolls_back_and_leaves_its_session_idle(server):
    owner = factories.community("localhost")
    key = secret()
    factories.committed(factories.Step(owner=owner, targets=[pubkey(key)]))
    with AgentClient(base_url(server), key) as agent:
        lease, _record = agent.claim(lease_seconds=30)
        before = AgentRequestReplay.objects.count()
        stale = dataclasses.replace(lease, generation=lease.generation + 1)
        # The wrong generation: 409, and its transaction (with the replay row) undone.
        assert agent.finish(stale, "finished") == LeaseLost()
        assert AgentRequestReplay.objects.count() == before
        sessions = server_sessions()
        assert [state for _, state in sessions] == ["idle"]
        # The same session goes on to serve the honest request.
        assert agent.finish(lease, "finished") == Settled(Outcome.FINISHED)
        assert server_sessions() == sessions
        assert AgentRequestReplay.objects.count() == before + 1


def test_a_session_ended_under_the_server_is_replaced_before_a_request_uses_it(server):
    key = enrolled_secret(factories.community("localhost"))
    with AgentClient(base_url(server), key) as agent:
        assert agent.claim() is None
        ((pid, _state),) = server_sessions()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        deadline = time.monotonic() + 5
        while server_sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        # The health check finds the dead session and opens a new one: not a 500.
        assert agent.claim() is None
        ((replacement, _state),) = server_sessions()
        assert replacement != pid
        # The same before a request served in a transaction (a read).
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [replacement])
        deadline = time.monotonic() + 5
        while server_sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.get(uuid.uuid4()) is None
        ((third, _state),) = server_sessions()
        assert third not in (pid, replacement)


def test_a_wait_keeps_the_thread_s_session_for_the_requests_after_it(server):
    key = enrolled_secret(factories.community("localhost"))
    with AgentClient(base_url(server), key) as agent:
        assert agent.claim() is None
        sessions = server_sessions()
        assert agent.wait(timeout=1) is None
        assert agent.claim() is None
        assert server_sessions() == sessions


def test_a_body_refused_after_authentication_leaves_the_session_idle(server):
    key = enrolled_secret(factories.community("localhost"))
    with AgentClient(base_url(server), key) as agent:
        assert agent.claim() is None
        sessions = server_sessions()
        before = AgentRequestReplay.objects.count()
        # Signed as sent, so it passes authentication; then it is not JSON.
        assert send_signed(server, key, b"{not json") == (400, "invalid_json")
        assert AgentRequestReplay.objects.count() == before
        assert [state for _, state in server_sessions()] == ["idle"]
        assert agent.claim() is None
        assert server_sessions() == sessions


def send_signed(server: str, key: bytes, body: bytes) -> tuple[int, str]:
    """POST ``body`` to ``v1/claim``, signed for exactly that body: (status, error code)."""
    port = int(server.rsplit(":", 1)[1])
    url = f"http://localhost:{port}/agents/v1/claim"
    header = nip98.sign_request(key, url=url, method="POST", body=body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Host": f"localhost:{port}", "Authorization": header}
        conn.request("POST", "/agents/v1/claim", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())["error"]
    finally:
        conn.close()


# -- an over-size body, read no further than its limit ----------------------------------


def raw_post(server: str, path: str, headers: list[str], body_chunks=()) -> tuple[int, bytes]:
    """POST over a raw socket: the head, then each chunk until the server answers;
    then the answer's status and body as the server sent them (up to its closing the
    connection, or 10 s)."""
    port = int(server.rsplit(":", 1)[1])
    head = "\r\n".join([f"POST {path} HTTP/1.1", f"Host: localhost:{port}", *headers, "", ""])
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered: what is left is never sent
            try:
                sock.sendall(chunk)
            except OSError:
                break  # answered and closed
        while not _complete(answer):
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break  # the server closed with bytes of ours unread; its answer came first
            if not data:
                break
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def chunked(size: int, chunk: int = 16384):
    """``size`` bytes as HTTP/1.1 chunks, with no last chunk: the body never ends."""
    for _ in range(size // chunk):
        yield b"%x\r\n" % chunk + b"x" * chunk + b"\r\n"


@pytest.mark.parametrize("path", ["/agents/v1/claim", "/admin/login/", "/no/such/path"])
def test_a_declared_length_over_the_limit_is_refused_before_any_body_is_sent(server, path):
    """256 MiB declared and none of it sent: only a server that reads nothing answers."""
    status, body = raw_post(server, path, ["Content-Length: 268435456"])
    assert status == 413
    assert json.loads(body)["error"] == "body_too_large"


@pytest.mark.parametrize("path", ["/agents/v1/claim", "/admin/login/"])
def test_a_chunked_body_is_refused_once_it_passes_the_limit(server, path):
    """A body with no length that never ends: the server stops reading at the limit
    (64 KiB on the agent API, Django's 2.5 MiB elsewhere) and answers."""
    status, body = raw_post(server, path, ["Transfer-Encoding: chunked"], chunked(4 * 1024 * 1024))
    assert status == 413
    assert json.loads(body)["error"] == "body_too_large"


def test_a_body_within_the_limit_is_read_whole(server):
    """Chunked and just under the limit: read, and refused only for its signature."""
    document = b'{"lease_seconds": 30,' + b" " * 65000 + b"}"
    chunks = [b"%x\r\n" % len(document) + document + b"\r\n", b"0\r\n\r\n"]
    status, body = raw_post(server, "/agents/v1/claim", ["Transfer-Encoding: chunked"], chunks)
    assert (status, json.loads(body)["error"]) == (401, "auth_missing")


@pytest.mark.parametrize("limit", [-1, True, 1.5, "64k"])
def test_the_handler_refuses_a_body_limit_that_is_not_a_whole_number(limit):
    with pytest.raises(ValueError, match="max_body_bytes must be None or a whole number"):
        PooledThreadsHandler(1, limit)


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_the_handler_refuses_a_thread_count_that_is_not_a_positive_whole_number(threads):
    with pytest.raises(ValueError, match="threads must be a positive whole number"):
        PooledThreadsHandler(threads)


def asgi_get(handler: PooledThreadsHandler, path: str) -> int:
    """GET ``path`` from ``handler`` in this process; the answer's status."""

    async def call() -> int:
        pending = [{"type": "http.request", "body": b"", "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()  # the client never goes away
            raise AssertionError

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"localhost")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 80),
        }
        await handler(scope, receive, send)
        return sent[0]["status"]

    return asyncio.run(call())


@pytest.mark.parametrize(
    "path, status",
    [("/agents/v1/openapi.json", 200), ("/nowhere", 404)],
    ids=["a synchronous view, in one call", "no view, Django's path"],
)
def test_a_request_starts_and_finishes_on_the_handler_s_long_lived_thread(path, status):
    handler = PooledThreadsHandler(threads=1)
    seen: list[tuple[str, str]] = []

    def started(**kwargs: object) -> None:
        seen.append(("started", threading.current_thread().name))

    def finished(**kwargs: object) -> None:
        seen.append(("finished", threading.current_thread().name))

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        assert asgi_get(handler, path) == status
        assert asgi_get(handler, path) == status
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)
    names = {name for _, name in seen}
    assert [event for event, _ in seen] == ["started", "finished"] * 2
    assert len(names) == 1 and names.pop().startswith("django-sync-0")


def test_a_request_goes_to_the_least_busy_thread_and_between_equals_not_the_oldest_busy():
    handler = PooledThreadsHandler(threads=3)
    handler._in_flight = [[100.0], [250.0], [90.0, 300.0]]
    # Threads 0 and 1 hold one request each; 0's began first, so it may be stuck.
    assert handler._pick_thread() == 1
    handler._in_flight[1].append(260.0)
    assert handler._pick_thread() == 0
    handler._in_flight[2] = []
    assert handler._pick_thread() == 2


def test_a_parked_claim_woken_after_its_thread_s_session_ended_claims_on_a_new_one(server):
    """The claim after a wake-up runs once the request's Django part is over: the
    thread's session, ended while the claim was parked, is replaced before the claim
    uses it, as before a request's first statement."""
    owner = factories.community("localhost")
    key = enrolled_secret(owner)
    result: dict = {}

    def wait_for_it() -> None:
        with AgentClient(base_url(server), key, timeout=30) as agent:
            result["claimed"] = agent.claim(wait=20, lease_seconds=30)

    waiting = threading.Thread(target=wait_for_it, daemon=True)
    waiting.start()
    idle = IdleWakeTarget.objects.filter(community_id=owner.id, target_pubkey=pubkey(key))
    deadline = time.monotonic() + 15
    while not idle.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle.exists()
    ((pid, _state),) = server_sessions()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    deadline = time.monotonic() + 5
    while server_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    step = factories.Step(owner=owner, targets=[pubkey(key)])
    (delivery,) = step.new_deliveries()
    commit_deliveries(owner.id, step.created_at, [delivery])
    waiting.join(30)
    _lease, record = result["claimed"]
    assert record.id == delivery.id
    ((replacement, _state),) = server_sessions()
    assert replacement != pid
