"""A request's database connection: the health check made before a request's first
statement, and the connection of a waiting request, released while it waits and
bounded while it works (the wait gate) unless it outlives the request anyway."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.handlers.wsgi import WSGIRequest
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpRequest

from ..store import django_adapter as django
from .asgi import on_pooled_thread


def _usable(raw: Any) -> bool:
    """Whether an idle connection can take a statement, judged without a round trip:
    not closed or broken, and nothing waiting to be read on its socket (an idle
    session in autocommit is sent nothing unasked, so anything readable is the end
    of the session: the server's goodbye or the socket's EOF)."""
    if getattr(raw, "closed", True) or getattr(raw, "broken", False):
        return False
    try:
        readable, _, _ = select.select([raw.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def check_connection(using: str = DEFAULT_DB_ALIAS) -> None:
    """Django's per-request health check (``CONN_HEALTH_CHECKS``) made without its
    ``SELECT 1``: a reused connection found unusable is closed, and the next
    statement opens a new one. Before a transaction begins, so a dead session is
    never the one its BEGIN is sent on."""
    wrapper = connections[using]
    if not django.health_check_pending(wrapper):
        return
    raw = django.raw(wrapper)
    if raw is not None and not django.in_transaction(wrapper) and not _usable(raw):
        wrapper.close()
    django.health_check_made(wrapper)


# Waits are many and long, their database work short: this bounds how many waits of
# one process use a connection at once, so a crowd of waiters can never take all of
# the server's connections (claims, renews and finishes are not gated).
wait_gate = threading.BoundedSemaphore(4)


def outlives_request(request: HttpRequest) -> bool:
    """Whether this thread's connection outlives the request anyway: a pooled thread's
    (``asgi.PooledThreadsHandler``), or a WSGI server thread's with persistent
    connections (``CONN_MAX_AGE`` not 0), which serves the thread's next request.
    Closing such a connection while the request waits frees no session for long, and
    costs the wait's next statement (the claim after a wake-up) a new one. The server's
    threads bound how many such connections there are."""
    if on_pooled_thread():
        return True
    max_age = connections[DEFAULT_DB_ALIAS].settings_dict.get("CONN_MAX_AGE", 0)
    return isinstance(request, WSGIRequest) and max_age != 0


@contextmanager
def waiting_work(request: HttpRequest) -> Iterator[None]:
    """A waiting request's database work: through the wait gate, and the connection
    released after it, so the wait itself holds none; where the connection outlives
    the request anyway (``outlives_request``), on the thread's own connection, with
    no gate."""
    if outlives_request(request):
        yield
        return
    with wait_gate:
        try:
            yield
        finally:
            release_connection()


def release_connection() -> None:
    """Close this thread's connection unless a transaction holds it: a waiting request
    needs none while it waits (CONN_MAX_AGE would otherwise keep it until the end)."""
    connection = connections[DEFAULT_DB_ALIAS]
    if not django.in_transaction(connection):
        connection.close()
