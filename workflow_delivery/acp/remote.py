"""``ApiAgent``: the ACP runtime without the database. Each delivery is claimed, its
lease renewed and the delivery settled through the signed HTTP API
(``workflow_delivery.client``), the MCP tools answered over the same API; the turn
itself is ``turns``'s, as in process. Imports no Django: it runs on the ``[acp-client]``
install (the client, the ACP and MCP SDKs, uvicorn).

``concurrency`` worker threads each hold a client of their own (one connection, one
request at a time) and loop: a claim that waits up to ``wait_seconds`` for a
delivery (the API's ``wait``, woken by the producers' notifications), a turn, a
settle. While a turn runs its worker renews the lease every ``LIVENESS_INTERVAL``
seconds; a renew answered ``lease_lost`` (or refused because the key was revoked or
the community is gone) cancels the turn at once (fenced: no tool call does anything
from then on) and settles nothing. A renew that cannot get through keeps the turn
going until the lease, counted from the last renew that did, would have run out.

Settling follows the turn's verdict: ``finished``, ``failed`` with the reason kept
(``finish`` with ``error``), or retried with the error kept (``retry``: the server's
backoff and attempt cap). ``stop()`` (SIGTERM in ``python -m workflow_delivery.acp``)
makes no new claims and cancels the turns in flight, whose leases, and any a waiting
claim still brings, are released. A settle that does not get through is tried
again while the lease may still live.

The ``reply`` tool is the API's ``reply`` (its idempotency key the digest of the
call's arguments, so the same call asked again sends once), ``read_message`` the
delivery's message as claimed with the run's replies (``replies``), ``fail`` a
reason the settle sends. What the agent said in the turn (its text, cut at
``TRANSCRIPT_BYTES``, its tool calls and permission requests) goes with the settle
(``turn_document``) and is stored in its transaction, as in process; a server that
refuses it (a smaller bound) gets the settle without it."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..client import AgentClient
from ..exceptions import AgentApiError, LeaseNotLive
from ..protocol import (
    AlreadyTerminal,
    Claimed,
    DeliveryRecord,
    Exhausted,
    Lease,
    LeaseLost,
    MessageEvent,
    Retried,
    Settled,
)
from .runtime import AgentRuntime, Turn
from .turns import (
    Verdict,
    drive,
    note_failure,
    prompt_blocks,
    read_document,
    reply_key,
    tools_server,
    verdict,
)

__all__ = ["ApiAgent", "ApiStats", "turn_document"]

logger = logging.getLogger(__name__)

# What a request that did not get through raises.
NETWORK_ERRORS = (OSError, http.client.HTTPException)
# The text of the agent's turn kept, and the most its settle's turn document takes
# (encoded), within the server's default body bound (64 KiB).
TRANSCRIPT_BYTES = 16384
TURN_DOCUMENT_BYTES = 48 * 1024
# The longest pause after a claim that did not get through.
MAX_BACKOFF = 5.0
# Refusals of a renew that say the lease cannot be live any more: the key revoked or
# never enrolled, the community gone or fenced (its deletion releases nothing, but
# no write of the lease can commit).
LEASE_ENDING_CODES = frozenset(
    {"auth_revoked", "auth_unknown_agent", "unknown_community", "community_fenced"}
)


@dataclass
class ApiStats:
    """What the runner did, counted by its workers."""

    claimed: int = 0
    finished: int = 0
    failed: int = 0
    retried: int = 0
    released: int = 0
    lost: int = 0
    errors: int = 0

    def line(self) -> str:
        return " ".join(f"{item.name}={getattr(self, item.name)}" for item in fields(self))


def turn_document(turn: Turn, budget: int = TURN_DOCUMENT_BYTES) -> dict[str, Any]:
    """What the agent said in ``turn``, as a settle sends it, encoded in at most
    ``budget`` bytes: its tool calls and permission requests halved, then its text,
    until it fits."""
    tool_calls = list(turn.tool_calls.values())
    permissions = list(turn.permissions)
    text = turn.text
    while True:
        document = {
            "text": text,
            "said_bytes": turn.said,
            "stop_reason": None if turn.stop_reason is None else turn.stop_reason[:100],
            "tool_calls": tool_calls,
            "permissions": permissions,
        }
        if len(json.dumps(document).encode()) <= budget:
            return document
        if tool_calls or permissions:
            tool_calls = tool_calls[: len(tool_calls) // 2]
            permissions = permissions[: len(permissions) // 2]
        else:
            text = text.encode()[: len(text.encode()) // 2].decode(errors="ignore")


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "the turn failed"
    return f"{type(error).__name__}: {error}"[:4000]


class _ApiLease:
    """A lease held through the API, as a turn's lease source: ``live()`` renews it."""

    def __init__(
        self, client: AgentClient, lease: Lease, lease_seconds: int, stopping: threading.Event
    ) -> None:
        self.client = client
        self.lease = lease
        self.lease_seconds = lease_seconds
        self.lost = threading.Event()
        self.stopping = stopping
        self._renewed_at = time.monotonic()

    def live(self) -> bool:
        try:
            result = self.client.renew(self.lease, lease_seconds=self.lease_seconds)
        except AgentApiError as exc:
            if exc.code in LEASE_ENDING_CODES:
                logger.warning("renewing %s refused: %s", self.lease.delivery_id, exc)
                return False
            logger.warning("renewing %s failed: %s", self.lease.delivery_id, exc)
            return time.monotonic() - self._renewed_at < self.lease_seconds
        except NETWORK_ERRORS as exc:
            logger.warning("renewing %s failed: %s", self.lease.delivery_id, exc)
            return time.monotonic() - self._renewed_at < self.lease_seconds
        if isinstance(result, LeaseLost):
            return False
        self._renewed_at = time.monotonic()
        return True


class _ApiEffects:
    """What the MCP tools do, on the worker's thread, through the API."""

    def __init__(
        self, client: AgentClient, lease: Lease, record: DeliveryRecord, message: MessageEvent
    ) -> None:
        self.client = client
        self.lease = lease
        self.record = record
        self.message = message
        self.failure: str | None = None
        self.replies: list[str] = []

    def read(self) -> dict[str, Any]:
        replies = self.client.replies(self.record.id) or []
        return read_document(self.record, self.message, replies)

    def reply(self, content: object, to: object) -> str:
        key = reply_key(content, to)
        sent = self.client.reply(self.lease, content, to, idempotency_key=key)  # type: ignore[arg-type]
        if isinstance(sent, LeaseLost):
            raise LeaseNotLive(self.lease, "the lease is gone")
        self.replies.append(sent.message_id.hex())
        state = "sent" if sent.created else "already sent"
        return f"reply {sent.message_id.hex()} {state} to {len(sent.deliveries)} agent(s)"

    def fail(self, reason: object) -> str:
        return note_failure(self, reason)


class ApiAgent:
    """Drive ``command`` (an ACP agent over stdio) for the key of the clients that
    ``client_factory`` makes (see the module's docstring).

    ``check()`` makes one signed request that claims nothing (a ``wait`` of no
    time): an API that cannot be reached, or refuses the key, raises there.
    ``run()`` checks, starts the agent (``AgentStartError`` if it cannot be started
    and initialised; nothing is claimed then), handles deliveries until ``stop()``,
    ``stop`` returning true, or ``max_deliveries``, then stops the agent and returns
    the counts."""

    def __init__(
        self,
        client_factory: Callable[[], AgentClient],
        command: Sequence[str],
        *,
        lease_seconds: int = 30,
        concurrency: int = 1,
        max_deliveries: int | None = None,
        turn_timeout: float | None = None,
        handshake_timeout: float = 10.0,
        wait_seconds: int = 10,
        allow: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.client_factory = client_factory
        self.lease_seconds = lease_seconds
        self.concurrency = concurrency
        self.max_deliveries = max_deliveries
        self.turn_timeout = turn_timeout
        self.wait_seconds = wait_seconds
        self.runtime = AgentRuntime(
            command, env=env, handshake_timeout=handshake_timeout, allow=allow
        )
        self.runtime.tools_server = tools_server(self.runtime.turn_for_token)
        self.stats = ApiStats()
        #: Monotonic instants a cancel was sent (a lost lease, a stop, a timeout).
        self.cancelled_at: list[float] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._taken = 0

    def stop(self) -> None:
        self._stopping.set()

    def check(self) -> None:
        with self.client_factory() as client:
            client.wait(timeout=0)

    def run(self, stop: Callable[[], bool] | None = None) -> ApiStats:
        self.check()
        self.runtime.start()
        try:
            workers = [
                threading.Thread(target=self._work, name=f"acp-api-{n}", daemon=True)
                for n in range(self.concurrency)
            ]
            for worker in workers:
                worker.start()
            while any(worker.is_alive() for worker in workers):
                if stop is not None and stop():
                    self._stopping.set()
                for worker in workers:
                    worker.join(0.1)
        finally:
            self._stopping.set()
            self.runtime.close()
        return self.stats

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _reserve(self) -> bool:
        with self._lock:
            if self.max_deliveries is not None and self._taken >= self.max_deliveries:
                return False
            self._taken += 1
            return True

    def _unreserve(self) -> None:
        with self._lock:
            self._taken -= 1

    def _work(self) -> None:
        client = self.client_factory()
        backoff = 0.0
        try:
            while not self._stopping.is_set() and self._reserve():
                try:
                    claimed = client.claim(lease_seconds=self.lease_seconds, wait=self.wait_seconds)
                except (*NETWORK_ERRORS, AgentApiError) as exc:
                    self._unreserve()
                    self._count("errors")
                    backoff = min(MAX_BACKOFF, backoff * 2 or 0.2)
                    logger.warning("claiming failed: %s; again in %.1f s", exc, backoff)
                    self._stopping.wait(backoff)
                    continue
                backoff = 0.0
                if claimed is None:
                    self._unreserve()
                    continue
                try:
                    self._handle(client, claimed)
                except Exception:
                    self._count("errors")
                    logger.exception("handling %s failed", claimed.lease.delivery_id)
        finally:
            client.close()

    def _handle(self, client: AgentClient, claimed: Claimed) -> None:
        lease, record, message = claimed.lease, claimed.record, claimed.message
        self._count("claimed")
        if self._stopping.is_set():
            self._release(client, lease)
            return
        if message is None:
            self._settle(client, lease, Verdict("failed", reason="the delivery's message is gone"))
            return
        turn = Turn(
            run_id=record.binding.run_id,
            delivery_id=record.id,
            blocks=prompt_blocks(record, message),
            max_bytes=TRANSCRIPT_BYTES,
        )
        turn.effects = _ApiEffects(client, lease, record, message)
        source = _ApiLease(client, lease, self.lease_seconds, self._stopping)
        why = drive(
            self.runtime,
            turn,
            source,
            turn_timeout=self.turn_timeout,
            cancelled_at=self.cancelled_at,
        )
        if why == "lost":
            logger.warning("the lease of %s was lost during the turn", lease.delivery_id)
            self._count("lost")
        elif why == "stopping":
            self._release(client, lease)
        else:
            found = verdict(turn, why, self.turn_timeout)
            self._settle(client, lease, found, turn_document(turn))

    def _retrying(self, action: Callable[[], Any], lease: Lease) -> Any:
        """``action()``, tried again after a request that did not get through for as
        long as the lease may live; None if it never got through."""
        deadline = time.monotonic() + self.lease_seconds
        backoff = 0.1
        while True:
            try:
                return action()
            except NETWORK_ERRORS as exc:
                if time.monotonic() + backoff > deadline:
                    logger.warning("gave up on %s: %s", lease.delivery_id, exc)
                    return None
                time.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)

    def _settle(
        self, client: AgentClient, lease: Lease, found: Verdict, turn: dict | None = None
    ) -> None:
        if found.settle == "finished":

            def settle(turn: dict | None) -> Any:
                return client.finish(lease, "finished", turn=turn)

        elif found.settle == "failed":
            reason = found.reason or "the turn failed"

            def settle(turn: dict | None) -> Any:
                return client.fail(lease, reason, turn=turn)

        else:
            logger.info("delivery %s will be retried: %s", lease.delivery_id, found.error)
            error = _error_text(found.error)

            def settle(turn: dict | None) -> Any:
                return client.retry(lease, error, turn=turn)

        try:
            result = self._retrying(lambda: settle(turn), lease)
        except AgentApiError as exc:
            if turn is None or exc.status not in (400, 413):
                raise
            # The server keeps a smaller transcript, or takes smaller bodies: the
            # settle counts more than what the agent said.
            logger.warning(
                "the turn of %s was refused (%s); settling without it", lease.delivery_id, exc
            )
            result = self._retrying(lambda: settle(None), lease)
        if isinstance(result, Settled):
            self._count(result.outcome.value)
        elif isinstance(result, AlreadyTerminal):
            self._count(result.status.value)
        elif isinstance(result, Retried):
            self._count("retried")
        elif isinstance(result, Exhausted):
            self._count("failed")
        else:
            self._count("lost")

    def _release(self, client: AgentClient, lease: Lease) -> None:
        released = self._retrying(lambda: client.release(lease), lease)
        self._count("released" if released else "lost")
