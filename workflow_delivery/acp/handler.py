"""The thread side of the ACP runtime: a ``Consumer`` handler that turns a claimed
delivery into one agent turn, and the MCP tools bound to that turn's lease.

``AcpHandler(runtime)`` is the handler: it prompts the agent (``session/prompt``: the
message's text, then its delivery, run and message ids as an embedded resource) and,
while the turn runs, the Consumer's heartbeat renews the lease. The handler's thread
waits on the turn's future, runs the database work the MCP tools ask for, and checks
the lease twice a second; the moment it is gone (reaped, released, the key revoked),
the runtime is stopping, or ``turn_timeout`` passes, the turn is fenced (no tool call
does anything from then on) and ``session/cancel`` is sent. An agent that does not
end a cancelled turn within ``CANCEL_GRACE`` seconds is stopped.

How the turn ends decides the settlement: ``end_turn`` finished (or failed with the
reason, if the agent called the ``fail`` tool); ``refusal``, ``max_tokens`` and
``max_turn_requests`` failed with the reason kept, never retried; a dead agent, a
protocol error, a timeout or a turn cancelled by the agent itself retried with the
Consumer's backoff and cap, the error kept; a lost lease settles nothing; a stop
gives the lease back.

What the agent said in the turn (its streamed text, cut at
``WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES``, its tool calls and permission requests)
is stored with the settle of the attempt, in the settle's transaction, whether the
delivery finished, failed or is retried (``services.keep_agent_turn``). A lost lease,
or a stop that gives the lease back, stores nothing.

The tools (``tools_server``): ``read_message`` (the message, its run and step, the
replies stored so far in the run), ``reply(content, to)`` (a message of the same run,
tagged as a reply to the delivered one, sent to the enrolled agents in ``to``,
written inside ``holding()`` so a reply under a lost lease commits nothing; its
idempotency key comes from the delivery and the call's arguments, so the same call
retried, in this turn or a later attempt, sends once) and ``fail(reason)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from .. import services
from ..conf import app_settings
from ..consumer import DeliveryContext, GiveBack, PermanentFailure
from ..exceptions import LeaseNotLive, ProtocolError, WorkflowDeliveryError
from ..protocol import (
    DeliveryRecord,
    DeliveryStatus,
    Lease,
    MessageEvent,
    Retried,
    Settled,
)
from .runtime import AgentError, AgentRuntime, Turn

__all__ = ["CANCEL_GRACE", "AcpHandler", "TurnTimeout", "tools_server"]

logger = logging.getLogger(__name__)

# How long a cancelled turn may take to end before the agent is stopped.
CANCEL_GRACE = 3.0
# How often the handler's thread asks the database whether the lease is still live.
LIVENESS_INTERVAL = 0.5
REPLY_MARKER = "reply"
FAILED_STOP_REASONS = frozenset({"refusal", "max_tokens", "max_turn_requests"})


class TurnTimeout(AgentError):
    """The turn ran past the runtime's turn timeout; it was cancelled, the delivery
    is retried."""


class _Effects:
    """What the MCP tools do, on the handler's thread, under the turn's lease."""

    def __init__(self, context: DeliveryContext, message: MessageEvent, using: str) -> None:
        self.context = context
        self.record = context.record
        self.message = message
        self.using = using
        self.failure: str | None = None
        self.replies: list[str] = []

    def read(self) -> dict[str, Any]:
        binding = self.record.binding
        replies = [
            {"id": event_id, "content": content, "pubkey": pubkey}
            for event_id, content, pubkey in _replies_in_run(
                binding.community_id, binding.run_id, self.using
            )
        ]
        return {
            "delivery_id": str(self.record.id),
            "run_id": str(binding.run_id),
            "step_id": binding.step_id,
            "message": {
                "id": self.message.id.hex(),
                "pubkey": self.message.pubkey.hex(),
                "content": self.message.content,
                "tags": self.message.tags,
            },
            "replies": replies,
        }

    def reply(self, content: object, to: object) -> str:
        if not isinstance(content, str) or not content.strip():
            raise ProtocolError("content", "must be a non-empty string")
        limit = app_settings.ACP_REPLY_BYTES
        if len(content.encode()) > limit:
            raise ProtocolError(
                "content", f"is {len(content.encode())} bytes; a reply may have at most {limit}"
            )
        if not isinstance(to, list) or not to or not all(isinstance(key, str) for key in to):
            raise ProtocolError("to", "must name at least one agent key (64 hex characters)")
        binding = self.record.binding
        arguments = json.dumps([content, sorted(key.lower() for key in to)])
        digest = hashlib.sha256(f"{self.record.id}|{arguments}".encode()).hexdigest()
        key = f"{REPLY_MARKER}-{digest[:48]}"
        with self.context.holding():
            sent = services.send_message(
                binding.community_id,
                targets=to,
                content=content,
                idempotency_key=key,
                run_id=binding.run_id,
                tags=[["e", self.message.id.hex(), "", REPLY_MARKER]],
                sender=binding.target_pubkey,
                using=self.using,
            )
        self.replies.append(sent.message.id.hex())
        state = "sent" if sent.created else "already sent"
        return f"reply {sent.message.id.hex()} {state} to {len(sent.deliveries)} agent(s)"

    def fail(self, reason: object) -> str:
        if not isinstance(reason, str) or not reason.strip():
            raise ProtocolError("reason", "must be a non-empty string")
        self.failure = reason[:1000]
        return "the delivery will be settled failed when the turn ends"


def _replies_in_run(community_id: Any, run_id: Any, using: str) -> list[tuple[str, str, str]]:
    from ..models import Event

    rows = (
        Event.objects.using(using)
        .filter(community_id=community_id, tags__contains=[["run", str(run_id)]])
        .order_by("created_at")
        .values_list("id", "content", "pubkey", "tags")[:100]
    )
    return [
        (bytes(event_id).hex(), content, bytes(pubkey).hex())
        for event_id, content, pubkey, tags in rows
        if any(tag[:1] == ["e"] and tag[-1:] == [REPLY_MARKER] for tag in tags)
    ]


def tools_server(runtime_turn: Any) -> Any:
    """The MCP server offered to every session. ``runtime_turn(token)`` finds the
    turn in progress in the session the bearer token was given to."""
    server = MCPServer(
        name="workflow-delivery",
        instructions=(
            "Tools of the delivery this turn works on: read_message, reply (to agents "
            "of the community, by public key), fail (settle the delivery failed)."
        ),
        log_level="WARNING",
    )

    def turn_of(ctx: Context) -> Turn:
        headers = ctx.headers or {}
        token = (headers.get("authorization") or "").removeprefix("Bearer ").strip()
        turn = runtime_turn(token) if token else None
        if turn is None:
            raise ToolError("no turn is in progress in this session")
        return turn

    async def on_thread(turn: Turn, work: Any) -> Any:
        try:
            return await asyncio.wrap_future(turn.call(work))
        except LeaseNotLive:
            raise ToolError("the delivery's lease is gone: nothing was stored") from None
        except (WorkflowDeliveryError, ValueError) as exc:
            raise ToolError(f"{exc}: nothing was stored") from None

    @server.tool(description="The delivered message, its run and step, the run's replies.")
    async def read_message(ctx: Context) -> str:
        turn = turn_of(ctx)
        return json.dumps(await on_thread(turn, turn.effects.read))

    @server.tool(description="Send a reply (a message of the same run) to agents by key.")
    async def reply(content: str, to: list[str], ctx: Context) -> str:
        turn = turn_of(ctx)
        return await on_thread(turn, lambda: turn.effects.reply(content, to))

    @server.tool(description="Settle the delivery failed, with this reason, when the turn ends.")
    async def fail(reason: str, ctx: Context) -> str:
        turn = turn_of(ctx)
        return await on_thread(turn, lambda: turn.effects.fail(reason))

    return server


def prompt_blocks(record: DeliveryRecord, message: MessageEvent) -> list[Any]:
    from acp import embedded_text_resource, resource_block, text_block

    ids = {
        "delivery_id": str(record.id),
        "run_id": str(record.binding.run_id),
        "step_id": record.binding.step_id,
        "message_id": message.id.hex(),
        "sender": message.pubkey.hex(),
    }
    resource = embedded_text_resource(
        f"workflow-delivery://delivery/{record.id}",
        json.dumps(ids),
        mime_type="application/json",
    )
    return [text_block(message.content), resource_block(resource)]


class AcpHandler:
    """A ``Consumer`` handler driving ``runtime`` (see the module's docstring)."""

    def __init__(
        self,
        runtime: AgentRuntime,
        *,
        turn_timeout: float | None = None,
        using: str = "default",
        on_turn: Any = None,
    ) -> None:
        self.runtime = runtime
        self.turn_timeout = turn_timeout
        self.using = using
        #: Called with (context, turn, verdict) on the handler's thread once a turn
        #: ends under a live lease, before it settles; what the turn said is stored
        #: with the settle (``services.keep_agent_turn``).
        self.on_turn = on_turn
        #: Monotonic instants a lost lease was seen and session/cancel sent (benchmarks).
        self.cancelled_at: list[float] = []

    def __call__(self, record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
        message = services.message_events(
            record.binding.community_id, [record], using=self.using
        ).get(record.id)
        if message is None:
            raise PermanentFailure(f"the message of delivery {record.id} is gone")
        turn = Turn(
            run_id=record.binding.run_id,
            delivery_id=record.id,
            blocks=prompt_blocks(record, message),
            max_bytes=app_settings.ACP_TRANSCRIPT_BYTES,
        )
        turn.effects = _Effects(context, message, self.using)
        why = self._drive(turn, lease, context)
        self._settle(turn, context, why)

    def _drive(self, turn: Turn, lease: Lease, context: DeliveryContext) -> str | None:
        """Wait for the turn, doing its tools' work; the reason it was cancelled, if
        it was."""
        future = turn.result = self.runtime.turn(turn)
        started = time.monotonic()
        next_check = started + LIVENESS_INTERVAL
        why: str | None = None
        cancel_deadline = 0.0
        try:
            while not future.done():
                turn.run_jobs(0.02)
                now = time.monotonic()
                if why is None:
                    if context.lost.is_set():
                        why = "lost"
                    elif context.stopping.is_set():
                        why = "stopping"
                    elif self.turn_timeout is not None and now - started > self.turn_timeout:
                        why = "timeout"
                    elif now >= next_check:
                        next_check = now + LIVENESS_INTERVAL
                        if not self._live(lease):
                            context.lost.set()
                            why = "lost"
                    if why is not None:
                        self.cancelled_at.append(time.monotonic())
                        logger.info("cancelling the turn of %s: %s", lease.delivery_id, why)
                        self.runtime.cancel(turn)
                        cancel_deadline = now + CANCEL_GRACE
                elif now > cancel_deadline:
                    logger.warning("the agent did not end the cancelled turn; stopping it")
                    self.runtime.abandon(turn)
                    break
        finally:
            turn.close()
        return why

    def _live(self, lease: Lease) -> bool:
        record = services.get_delivery(lease.community_id, lease.delivery_id, using=self.using)
        return (
            record is not None
            and record.status is DeliveryStatus.CLAIMED
            and record.lease_generation == lease.generation
        )

    def _settle(self, turn: Turn, context: DeliveryContext, why: str | None) -> None:
        if why == "lost":
            raise LeaseNotLive(context.lease, "the lease was lost during the turn")
        if why == "stopping":
            raise GiveBack("the runtime is stopping")
        outcome = self._verdict(turn, why)
        if self.on_turn is not None:
            self.on_turn(context, turn, outcome)
        context.with_settle.append(lambda result: self._keep(turn, context, result))
        if isinstance(outcome, BaseException):
            raise outcome

    def _keep(self, turn: Turn, context: DeliveryContext, result: object) -> None:
        """Store what the agent said, in the transaction of the settle (``result``)."""
        if isinstance(result, Settled):
            outcome = result.outcome.value
        elif isinstance(result, Retried):
            outcome = "retried"
        else:  # Exhausted: the retry used the last attempt and failed the delivery
            outcome = "failed"
        services.keep_agent_turn(
            context.lease,
            attempts=context.record.attempts,
            outcome=outcome,
            text=turn.text,
            said_bytes=turn.said,
            stop_reason=None if turn.stop_reason is None else turn.stop_reason[:100],
            tool_calls=list(turn.tool_calls.values()),
            permissions=turn.permissions,
            using=self.using,
        )

    def _verdict(self, turn: Turn, why: str | None) -> BaseException | None:
        if why == "timeout":
            return TurnTimeout(f"the turn ran past {self.turn_timeout:g} s and was cancelled")
        try:
            stop_reason = turn.result.result(timeout=0)
        except AgentError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - any failure of the turn is the agent's
            return AgentError(f"the turn failed: {exc!r}")
        turn.stop_reason = stop_reason
        if stop_reason == "end_turn":
            failure = turn.effects.failure
            return PermanentFailure(f"the agent failed it: {failure}") if failure else None
        if stop_reason in FAILED_STOP_REASONS:
            return PermanentFailure(f"the agent stopped the turn: {stop_reason}")
        return AgentError(f"the agent ended the turn {stop_reason!r} unasked")
