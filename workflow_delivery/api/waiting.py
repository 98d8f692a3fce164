"""The agent API's waits: a claim that waits (``POST v1/claim`` with ``wait``) and
``GET v1/wait``, woken by the producers' notifications through the process's hub
(``api.wake``), polling behind them. Their database work is waiting work
(``connection.waiting_work``): a wait holds no connection of its own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from uuid import UUID

from asgiref.sync import async_to_sync, sync_to_async
from django.db import Error as DatabaseError
from django.http import HttpRequest, HttpResponse

from .. import services
from ..conf import app_settings
from ..models import WorkflowAgentDelivery
from ..protocol import Claimed
from . import schema
from .answers import (
    Caller,
    answered,
    claimed_document,
    database_unavailable,
    error,
    request_caller,
)
from .asgi import Parked, parking_loop
from .auth import Signed, request_event
from .connection import check_connection, waiting_work
from .wake import Waiter, hub


def _first_claim(
    request: HttpRequest, signed: Signed, lease_seconds: int | None
) -> tuple[UUID, Claimed | None]:
    """The waiting claim's admission and first claim, in one statement."""
    with waiting_work(request):
        community_id, claimed = services.claim_admitted(
            request_event(signed), lease_seconds=lease_seconds
        )
    services.prune_replay_guard_now_and_then()
    return community_id, claimed


@dataclass(slots=True)
class _WaitingClaim:
    """A waiting claim past its admission: who waits, until when, its request and
    its waiter."""

    request: HttpRequest
    community_id: UUID
    pubkey: bytes
    lease_seconds: int | None
    deadline: float
    loop: asyncio.AbstractEventLoop
    waiter: Waiter | None = None

    def look(self, *, looked: bool = False) -> Claimed | None:
        """A claim once this waiter is registered (a new one when it has none or it
        was woken), on the request's thread. Finding nothing while the process
        listens, the caller's target is registered as idle and claimed for once more,
        so a commit lands either before that claim or after the registration, which
        makes its producer notify; when this process registered it already and no
        notification has consumed it since (``WakeHub.registered``, asked once the
        waiter is registered), it stands and nothing more is asked. ``looked``: a
        claim was made just before (the admission's), so the first one here is left
        out."""
        if self.waiter is None or self.waiter.future.done():
            self.forget()
            self.waiter = hub.register(self.community_id, self.pubkey, loop=self.loop)
        listening = app_settings.NOTIFY is True and hub.ensure_listening()
        if not listening:
            hub.ensure_sweeping()
        if looked and (not listening or hub.registered(self.community_id, self.pubkey)):
            return None

        def claim() -> Claimed | None:
            return services.claim_enrolled(
                self.community_id, self.pubkey, lease_seconds=self.lease_seconds
            )

        def work() -> Claimed | None:
            # After a wake-up the request's Django part is over: the thread's session,
            # idle meanwhile, is checked as a request's first statement's is.
            check_connection()
            claimed = None if looked else claim()
            if claimed is not None or not listening:
                return claimed
            session = hub.session
            if session is None or hub.registered(self.community_id, self.pubkey):
                # No listening session to name yet: the hub wakes every waiter once it
                # has one, so nothing is registered meanwhile.
                return None
            hub.registering(self.community_id, self.pubkey)
            try:
                # The hub's session, not this request's: the request's connection may
                # be released while it waits, the hub's listens for the wake-up.
                services.register_idle(self.community_id, [self.pubkey], session=session)
            except BaseException:
                hub.forget_registration(self.community_id, self.pubkey)
                raise
            return claim()

        with waiting_work(self.request):
            claimed = work()
        if claimed is not None:
            self.forget()
        return claimed  # type: ignore[return-value]

    def forget(self) -> None:
        if self.waiter is not None:
            hub.unregister(self.community_id, self.pubkey, self.waiter)
            self.waiter = None


def claim_waiting(request: HttpRequest, signed: Signed, payload: schema.ClaimIn) -> HttpResponse:
    """Claim now, or as soon as a delivery is claimable for the caller within
    ``payload.wait`` seconds: woken by the producers' notifications as ``wait`` is
    (and, with wake-ups off, by the process's poll of every waiter at once, every
    ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``),
    each wake-up followed by a claim that only an enabled agent's key can make.

    The admission, the first claim, the waiter's registration and the look after it
    run here, on the request's thread, in the one call that ran the middleware; the
    wait itself is ``Parked`` on the event loop (``api.asgi``), which takes the
    thread again only for the claim after a wake-up. Where no handler would resume a
    parked answer (Django's own path, WSGI), the wait runs here to its end."""
    seconds = payload.lease_seconds
    community_id, claimed = _first_claim(request, signed, seconds)
    if claimed is not None:
        return answered(request, claimed_document(*claimed, claimed.message))
    if hub.waiting >= app_settings.API_MAX_WAITERS:
        return error(request, 503, "too_many_waiters", "this server has enough waiters; poll")
    loop = parking_loop()
    if loop is None:
        return async_to_sync(_wait_inline)(request, community_id, signed.pubkey, payload)
    waiting = _WaitingClaim(
        request,
        community_id,
        signed.pubkey,
        seconds,
        deadline=time.monotonic() + min(payload.wait, app_settings.API_MAX_WAIT_SECONDS),
        loop=loop,
    )
    try:
        claimed = waiting.look(looked=True)
    except BaseException:
        waiting.forget()
        raise
    if claimed is not None:
        return answered(request, claimed_document(*claimed, claimed.message))
    return Parked(lambda: _until_claimed(request, waiting))


async def _wait_inline(
    request: HttpRequest, community_id: UUID, pubkey: bytes, payload: schema.ClaimIn
) -> HttpResponse:
    """The waiting claim where nothing resumes a parked answer: its look after the
    registration and its wait, on an event loop of asgiref's."""
    waiting = _WaitingClaim(
        request,
        community_id,
        pubkey,
        payload.lease_seconds,
        deadline=time.monotonic() + min(payload.wait, app_settings.API_MAX_WAIT_SECONDS),
        loop=asyncio.get_running_loop(),
    )
    try:
        claimed = await sync_to_async(waiting.look)(looked=True)
    except BaseException:
        waiting.forget()
        raise
    if claimed is not None:
        return answered(request, claimed_document(*claimed, claimed.message))
    return await _until_claimed(request, waiting)


async def _until_claimed(request: HttpRequest, waiting: _WaitingClaim) -> HttpResponse:
    """The parked waiting claim: a look after each wake-up (a notification, the safety
    poll, or with wake-ups off the process's poll, ``WakeHub.ensure_sweeping``) until
    one claims, or 204 at its deadline. Between looks it holds only its waiter's
    future."""
    try:
        while (remaining := waiting.deadline - time.monotonic()) > 0:
            woken = waiting.waiter.future if waiting.waiter is not None else None
            if woken is not None:
                # asyncio.wait, not wait_for: the deadline must not cancel it.
                await asyncio.wait({woken}, timeout=remaining)
                if not woken.done():
                    continue
            try:
                claimed = await sync_to_async(waiting.look)()
            except DatabaseError as exc:
                # Past the view: answered here as its exception handler would.
                return database_unavailable(request, exc)
            if claimed is not None:
                return answered(request, claimed_document(*claimed, claimed.message))
    finally:
        waiting.forget()
    return HttpResponse(status=204)


def prepare_wait(request: HttpRequest, caller: Caller) -> UUID | None:
    """After the waiter is registered and, with wake-ups on, the listener LISTENs: the
    oldest pending delivery already there (committed before we listened), or None.
    Finding none while listening, the caller's target is registered as idle
    (``services.register_idle``) and looked at once more, so a commit lands either
    before that look or after the registration, which makes its producer notify.
    With wake-ups off nothing is sent to listen for; the process's poll of every
    waiter at once (``WakeHub.ensure_sweeping``) looks instead."""
    listening = app_settings.NOTIFY is True and hub.ensure_listening()
    if not listening:
        hub.ensure_sweeping()
    pending = _pending_delivery(request, caller)
    if pending is None and listening:
        pending = _pending_delivery(request, caller, register_idle=True)
    return pending


def _pending_delivery(
    request: HttpRequest, caller: Caller, *, register_idle: bool = False
) -> UUID | None:
    """The caller's oldest claimable delivery (pending and not backing off after a
    retry), or None; with ``register_idle``, asked once the caller's target is
    registered as idle. Waiting work (``connection.waiting_work``): the wait itself
    holds no connection of its own."""
    with waiting_work(request):
        session = hub.session
        if register_idle and session is not None:
            # The hub's session, not this request's (its own may be released meanwhile).
            services.register_idle(caller.community_id, [caller.pubkey], session=session)
        return (
            WorkflowAgentDelivery.objects.claimable()
            .for_target(caller.community_id, caller.pubkey)
            .order_by("created_at", "id")
            .values_list("id", flat=True)
            .first()
        )


def admit_waiting(request: HttpRequest) -> Caller:
    """A waiting request's admission in autocommit (the wait holds no transaction
    while it waits), as waiting work (``connection.waiting_work``)."""
    with waiting_work(request):
        caller = request_caller(request)
        services.prune_replay_guard_now_and_then()
        return caller


async def until_woken(woken: asyncio.Future[UUID | None], timeout: float) -> UUID | None:
    """The delivery a wake-up names (a notification's, or the one the process's poll
    found: the safety poll, or with ``WORKFLOW_DELIVERY_NOTIFY`` off the poll every
    ``WORKFLOW_DELIVERY_API_WAIT_POLL_SECONDS``), or None at the timeout (or after the
    listener lost its session)."""
    # asyncio.wait, not wait_for: the timeout must not cancel the future.
    done, _ = await asyncio.wait({woken}, timeout=timeout)
    if done:
        return woken.result()
    return None
