"""An ASGI application for a project that serves the agent API: Django's, except
where each request's synchronous code runs.

Django's ``ASGIHandler`` gives every request a thread of its own for its synchronous
code (middleware, signal receivers, sync views). Database connections belong to a
thread, so each request then opens a new PostgreSQL session and, with persistent
connections, leaves it behind. ``PooledThreadsHandler`` runs each request's
synchronous code on one of a few long-lived threads instead, chosen per request, so
their connections are reused as a WSGI server's threads reuse theirs:

    # asgi.py
    from workflow_delivery.api.asgi import get_asgi_application

    application = get_asgi_application(threads=4)

Everything Django does per request stays: ``request_started`` and ``request_finished``
run ``close_old_connections()`` on the request's thread, so ``CONN_MAX_AGE`` and
``CONN_HEALTH_CHECKS`` apply as under WSGI. A transaction never spans two of a
request's synchronous calls (a view and its ``atomic`` run in one), so requests that
share a thread take turns between calls and never see each other's transaction.
With ``CONN_MAX_AGE = 0`` each request still closes its connection at its end.

A request for a synchronous view (claim, renew, finish, read) is served in one call
on its thread, as a WSGI server serves it: ``request_started``, the middleware in
their synchronous mode, the view, and for an answer that is not streamed
``request_finished``; only reading the body and sending the answer stay on the
event loop. Django's own path would move between the loop and the thread three
times for such a request. An asynchronous view (``wait``), or a path that resolves
to nothing, takes Django's path.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import django
from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.http import HttpResponseBase
from django.urls import Resolver404, get_resolver, set_script_prefix

_pooled = threading.local()


def on_pooled_thread() -> bool:
    """True on a thread of a ``PooledThreadsHandler``: its connection outlives the
    request and serves the next one."""
    return getattr(_pooled, "handler", False)


def _mark_pooled() -> None:
    _pooled.handler = True


def _takes_an_executor() -> bool:
    try:
        ThreadSensitiveContext(executor=None)
    except TypeError:
        return False
    return True


# asgiref 3.13 and later run a context's thread-sensitive calls on an executor its
# caller owns; before that each context makes (and shuts down) a thread of its own,
# and the handler then keeps only the one call per synchronous view.
POOLED_THREADS = _takes_an_executor()


class PooledThreadsHandler(ASGIHandler):
    """``ASGIHandler`` whose requests run their synchronous code on ``threads``
    long-lived threads, each request on the one with the fewest requests in flight."""

    def __init__(self, threads: int = 4) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive whole number, not {threads!r}")
        super().__init__()
        # One worker each: a request's synchronous calls must all run on one thread.
        self._executors = [
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"django-sync-{index}", initializer=_mark_pooled
            )
            for index in range(threads)
        ]
        self._in_flight = [0] * threads
        # The same middleware in their synchronous mode, for synchronous views.
        self._sync = BaseHandler()
        self._sync.load_middleware(is_async=False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            # Django's refusal of what is not HTTP.
            await super().__call__(scope, receive, send)
            return
        # Only the event loop's thread reads and writes the counts.
        index = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        if POOLED_THREADS:
            context = ThreadSensitiveContext(executor=self._executors[index])
        else:
            context = ThreadSensitiveContext()
        try:
            async with context:
                if self._synchronous_view(scope):
                    await self._handle_in_one_call(scope, receive, send)
                else:
                    await self.handle(scope, receive, send)
        finally:
            self._in_flight[index] -= 1

    @staticmethod
    def _synchronous_view(scope) -> bool:
        """Whether the path names a synchronous view of the root URLconf. Only the
        number of thread hops depends on it: either path serves any view."""
        script_name = scope.get("root_path", "")
        path = scope["path"]
        if script_name and path.startswith(script_name):
            path = path[len(script_name) :]
        try:
            match = get_resolver().resolve(path)
        except Resolver404:
            return False
        return not iscoroutinefunction(match.func)

    async def _handle_in_one_call(self, scope, receive, send) -> None:
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        try:
            response = await sync_to_async(self._respond)(scope, body_file)
            await self.send_response(response, send)
            if response.streaming:
                await sync_to_async(response.close)()
        finally:
            body_file.close()

    def _respond(self, scope, body_file) -> HttpResponseBase:
        """What Django's path does on the request's thread, in one call."""
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self._sync.get_response(request)
            response._handler_class = self.__class__
        if not response.streaming:
            # The answer is complete: the request is over for Django (its resources
            # closed, request_finished sent) before its bytes go out, as under WSGI
            # once a server has the body.
            response.close()
        return response


def get_asgi_application(threads: int = 4) -> PooledThreadsHandler:
    """Django's ``get_asgi_application()`` with a ``PooledThreadsHandler``."""
    django.setup(set_prefix=False)
    return PooledThreadsHandler(threads)
