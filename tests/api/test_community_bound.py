"""Under the app's ASGI handler (uvicorn, two threads) no one community holds every
thread: with one of its requests stuck in the database, its next request waits on
the event loop (half a second here) and is answered 503 ``community_busy``, and
another community's claim is served on the thread left free."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
from django.db import connection

from tests.api.helpers import enrolled_secret
from tests.support import factories
from tests.support.agent_http import uvicorn_server
from tests.support.consumers import eventually
from tests.support.second_session import other
from workflow_delivery.api import nip98
from workflow_delivery.api.asgi import POOLED_THREADS

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.psycopg3,
    pytest.mark.skipif(not POOLED_THREADS, reason="asgiref before 3.13: a thread per request"),
]


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    env = {"ASGI_THREADS": "2", "WORKFLOW_DELIVERY_API_IN_FLIGHT_WAIT_SECONDS": "0.5"}
    with uvicorn_server(extra_env=env) as url:
        yield url


def claim(server: str, host: str, key: bytes) -> tuple[int, dict, dict]:
    """A signed claim for ``host``: (status, answer, headers); times out after 10 s."""
    port = int(server.rsplit(":", 1)[1])
    url = f"http://{host}:{port}/agents/v1/claim"
    header = nip98.sign_request(key, url=url, method="POST", body=b"")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "POST",
            "/agents/v1/claim",
            body=b"",
            headers={"Host": f"{host}:{port}", "Authorization": header},
        )
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else {}, dict(response.getheaders())
    finally:
        conn.close()


def waiting_for_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)"
        )
        return cursor.fetchone()[0]


def test_a_community_cannot_hold_every_thread(server):
    busy, free = factories.community(), factories.community()
    busy_key, free_key = enrolled_secret(busy), enrolled_secret(free)
    with other() as revoker:
        # The roster's exclusive lock, as a revocation holds it: the busy community's
        # admission waits for it, on one of the server's two threads.
        revoker.execute("SELECT pg_advisory_xact_lock(wd_community_roster_key(%s))", [busy.id])
        stuck: list = []
        first = threading.Thread(target=lambda: stuck.append(claim(server, busy.host, busy_key)))
        first.start()
        try:
            assert eventually(waiting_for_a_lock, 5)
            status, document, headers = claim(server, busy.host, busy_key)
            assert (status, document["error"]) == (503, "community_busy")
            assert headers["Retry-After"] == "1"
            # The other thread is free for another community.
            assert claim(server, free.host, free_key)[0] == 204
        finally:
            revoker.rollback()
            first.join(15)
    assert stuck and stuck[0][0] == 204
