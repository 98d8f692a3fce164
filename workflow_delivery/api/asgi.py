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

No one community holds every thread: the agent API's synchronous requests in flight
for one host (one community) are bounded by
``WORKFLOW_DELIVERY_API_MAX_IN_FLIGHT_PER_COMMUNITY`` (by default one less than the
threads, at least one); a request over it waits on the event loop, not on a thread,
for one of them to finish, at most ``WORKFLOW_DELIVERY_API_IN_FLIGHT_WAIT_SECONDS``,
and is then answered 503 (``community_busy``, with ``Retry-After``).

A synchronous view may answer ``Parked``: its synchronous work done in that one call,
the rest of its answer is awaited on the event loop, holding no thread and no
in-flight slot (the agent API's waiting claim parks so: a parked request costs a
future and a connection's buffers, not a thread hop per look).

A body is read only up to its limit: ``WORKFLOW_DELIVERY_API_MAX_BODY_BYTES`` on the
agent API's paths, ``max_body_bytes`` on every other (by default Django's
``DATA_UPLOAD_MAX_MEMORY_SIZE``; ``None``: no limit, for a project that takes large
uploads). A request declaring a longer ``Content-Length`` is answered 413
(``body_too_large``) before any of its body is read, and a body sent without one
(chunked) is answered so as soon as it passes the limit, the rest left unread.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import django
from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.http import HttpResponse, HttpResponseBase
from django.urls import Resolver404, get_resolver, set_script_prefix

from ..conf import app_settings

_pooled = threading.local()

# The agent API's URL namespace and its docs page (api.views, api.urls).
_API_NAMESPACE = "workflow_delivery_api"
_API_URL_NAMES = frozenset({"workflow_delivery_api_docs"})

# The body limit of the request being read (None: none), for Django's own path.
_BODY_LIMIT: ContextVar[int | None] = ContextVar("workflow_delivery_body_limit", default=None)
# The event loop that resumes a parked answer (``Parked``) of the request being served
# in one call; None where no one would (Django's own path, WSGI, the test client).
_PARKING: ContextVar[asyncio.AbstractEventLoop | None] = ContextVar(
    "workflow_delivery_parking", default=None
)


class Parked(HttpResponse):
    """A synchronous view's answer still to come: the view has done its synchronous
    work (the middleware, authentication, admission and its first look ran once, on
    the request's thread) and the rest, ``resume()``, is awaited on the event loop
    without a thread, its answer sent in this one's place. The headers the middleware
    gave this placeholder are carried onto that answer (those it sets itself win).
    Only a view served in one call by ``PooledThreadsHandler`` may return one
    (``parking_loop()`` is then the loop that resumes it); its community's in-flight
    slot is given back while it waits."""

    def __init__(self, resume: Callable[[], Awaitable[HttpResponseBase]]) -> None:
        super().__init__(status=204)
        self.resume = resume


def parking_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop that would resume a ``Parked`` answer of the request being
    served, or None when nothing would (the view must then finish its work itself)."""
    return _PARKING.get()


_UNSET = object()


class _BodyTooLarge(Exception):
    """A body passed its limit while being read; ``limit`` is that limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


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

    def __init__(self, threads: int = 4, max_body_bytes: int | object | None = _UNSET) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive whole number, not {threads!r}")
        if (
            max_body_bytes is not _UNSET
            and max_body_bytes is not None
            and (
                isinstance(max_body_bytes, bool)
                or not isinstance(max_body_bytes, int)
                or max_body_bytes < 0
            )
        ):
            raise ValueError(
                f"max_body_bytes must be None or a whole number from 0, not {max_body_bytes!r}"
            )
        self._max_body_bytes = max_body_bytes
        super().__init__()
        # One worker each: a request's synchronous calls must all run on one thread.
        self._executors = [
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"django-sync-{index}", initializer=_mark_pooled
            )
            for index in range(threads)
        ]
        # Per thread, when each of its requests in flight began (the event loop's alone).
        self._in_flight: list[list[float]] = [[] for _ in range(threads)]
        # Per host, the slots of the agent API's synchronous requests and how many
        # requests hold or wait for one (the event loop's alone).
        self._per_host: dict[str, list] = {}
        # The same middleware in their synchronous mode, for synchronous views.
        self._sync = BaseHandler()
        self._sync.load_middleware(is_async=False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            # Django's refusal of what is not HTTP.
            await super().__call__(scope, receive, send)
            return
        synchronous, limit, api = self._route(scope)
        if limit is not None and _declared_length(scope) > limit:
            # Refused on its headers: none of the body is read.
            await self._refuse_body(send, limit)
            return
        host = _host(scope) if api and synchronous else None
        if host is not None and not await self._enter(host):
            detail = "too many requests of this community are in flight; try again shortly"
            await self._refuse(send, 503, "community_busy", detail, retry_after=1)
            return
        # Only the event loop's thread reads and writes the counts; the thread is
        # chosen once the request may take one.
        index = self._pick_thread()
        began = time.monotonic()
        self._in_flight[index].append(began)
        if POOLED_THREADS:
            context = ThreadSensitiveContext(executor=self._executors[index])
        else:
            context = ThreadSensitiveContext()
        token = _BODY_LIMIT.set(limit)
        held = [host]

        def give_back() -> None:
            # The community's slot and the thread's count, once: when the request
            # ends, or as soon as its answer is parked.
            if held:
                self._in_flight[index].remove(began)
                if held.pop() is not None:
                    self._leave(host)

        try:
            async with context:
                if synchronous:
                    await self._handle_in_one_call(scope, receive, send, give_back)
                else:
                    await self.handle(scope, receive, send)
        except _BodyTooLarge as exc:
            await self._refuse_body(send, exc.limit)
        finally:
            _BODY_LIMIT.reset(token)
            give_back()

    def _pick_thread(self) -> int:
        """The thread with the fewest requests in flight; between equals, the one whose
        oldest request began last, since a thread whose request has run longest is the
        likeliest to be stuck behind a lock (and a request finishing its answer still
        counts on its thread for a moment)."""

        def load(index: int) -> tuple[int, float]:
            requests = self._in_flight[index]
            return len(requests), -min(requests, default=0.0)

        return min(range(len(self._in_flight)), key=load)

    async def _enter(self, host: str) -> bool:
        """Take one of the host's slots, waiting on the event loop (not on a thread)
        at most ``WORKFLOW_DELIVERY_API_IN_FLIGHT_WAIT_SECONDS``; False when none freed."""
        slots = self._per_host.get(host)
        if slots is None:
            slots = self._per_host[host] = [asyncio.Semaphore(self._host_bound()), 0]
        slots[1] += 1
        try:
            await asyncio.wait_for(
                slots[0].acquire(), timeout=app_settings.API_IN_FLIGHT_WAIT_SECONDS
            )
        except TimeoutError:
            self._forget(host, slots)
            return False
        return True

    def _leave(self, host: str) -> None:
        slots = self._per_host[host]
        slots[0].release()
        self._forget(host, slots)

    def _forget(self, host: str, slots: list) -> None:
        slots[1] -= 1
        if not slots[1]:
            del self._per_host[host]

    def _host_bound(self) -> int:
        bound = app_settings.API_MAX_IN_FLIGHT_PER_COMMUNITY
        if bound is None:
            return max(1, len(self._executors) - 1)
        return bound

    def _route(self, scope) -> tuple[bool, int | None, bool]:
        """Whether the path names a synchronous view of the root URLconf (only the
        number of thread hops depends on it: either path serves any view), the
        longest body it takes, and whether it is the agent API's."""
        script_name = scope.get("root_path", "")
        path = scope["path"]
        if script_name and path.startswith(script_name):
            path = path[len(script_name) :]
        try:
            match = get_resolver().resolve(path)
        except Resolver404:
            return False, self._other_limit(), False
        synchronous = not iscoroutinefunction(match.func)
        if _API_NAMESPACE in match.namespaces or match.url_name in _API_URL_NAMES:
            return synchronous, app_settings.API_MAX_BODY_BYTES, True
        return synchronous, self._other_limit(), False

    def _other_limit(self) -> int | None:
        if self._max_body_bytes is _UNSET:
            return settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return self._max_body_bytes  # type: ignore[return-value]

    async def _refuse_body(self, send, limit: int) -> None:
        # The rest of the body is never read: the connection cannot carry another request.
        detail = f"the body must be at most {limit} bytes"
        await self._refuse(send, 413, "body_too_large", detail, close=True)

    async def _refuse(
        self,
        send,
        status: int,
        code: str,
        detail: str,
        *,
        retry_after: int | None = None,
        close: bool = False,
    ) -> None:
        """The API's error document, answered from the event loop (no thread)."""
        body = json.dumps({"error": code, "detail": detail})
        response = HttpResponse(body, status=status, content_type="application/json")
        response["Content-Length"] = str(len(response.content))
        if retry_after is not None:
            response["Retry-After"] = str(retry_after)
        if close:
            response["Connection"] = "close"
        await self.send_response(response, send)

    async def read_body(self, receive):
        """Django's, stopped with ``_BodyTooLarge`` as soon as the body passes the
        request's limit."""
        limit = _BODY_LIMIT.get()
        # Handed to the caller open, as Django's is (closed with the request).
        body_file = tempfile.SpooledTemporaryFile(  # noqa: SIM115
            max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b"
        )
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            if "body" in message:
                received += len(message["body"])
                if limit is not None and received > limit:
                    body_file.close()
                    raise _BodyTooLarge(limit)
                body_file.write(message["body"])
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    async def _handle_in_one_call(self, scope, receive, send, give_back) -> None:
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        parking = _PARKING.set(asyncio.get_running_loop())
        try:
            try:
                response = await sync_to_async(self._respond)(scope, body_file)
            finally:
                _PARKING.reset(parking)
            if isinstance(response, Parked):
                give_back()
                response = await self._resumed(response)
            await self.send_response(response, send)
            if response.streaming:
                await sync_to_async(response.close)()
        finally:
            body_file.close()

    async def _resumed(self, parked: Parked) -> HttpResponseBase:
        """A parked answer's own, with the headers the middleware gave the placeholder.
        Django's part of the request ended with the placeholder (it was closed, and
        ``request_finished`` sent, on the request's thread)."""
        response = await parked.resume()
        for name, value in parked.items():
            if name.lower() not in ("content-type", "content-length") and name not in response:
                response[name] = value
        if not response.streaming and not response.has_header("Content-Length"):
            response["Content-Length"] = str(len(response.content))
        for cookie in parked.cookies.values():
            if cookie.key not in response.cookies:
                response.cookies[cookie.key] = cookie
        return response

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


def get_asgi_application(
    threads: int = 4, max_body_bytes: int | object | None = _UNSET
) -> PooledThreadsHandler:
    """Django's ``get_asgi_application()`` with a ``PooledThreadsHandler``, in a
    process whose open-files limit is raised as far as it may be
    (``raise_open_files_limit``): each waiting request holds a socket."""
    django.setup(set_prefix=False)
    raise_open_files_limit()
    return PooledThreadsHandler(threads, max_body_bytes)


def raise_open_files_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` raised to its hard limit (which only the
    system's configuration can raise: ``ulimit -Hn``, systemd's ``LimitNOFILE``);
    returns the soft limit now in force, or -1 where there is no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (soft < hard or hard == resource.RLIM_INFINITY):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft


def _host(scope) -> str:
    """The request's Host, as the community is found by it: no case, no port."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"host":
            text = value.decode("latin-1").lower()
            return text.rsplit(":", 1)[0] if not text.endswith("]") else text
    return ""


def _declared_length(scope) -> int:
    """The request's ``Content-Length`` (0 when it has none or it is not a number:
    the body is then measured as it is read)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
