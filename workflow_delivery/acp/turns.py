"""One delivery's turn, whatever holds its lease: the prompt, the MCP tools bound to
the turn, the loop that waits for the turn while its lease lives, and the verdict its
stop reason gives. Imports no Django: the in-process handler (``handler``, leases
from the ``Consumer``) and the API runner (``remote``, leases from the signed HTTP
API) both drive turns through it.

A lease source (``LeaseSource``) tells the loop whether the lease still lives:
``lost`` and ``stopping`` are events it may set at any time, and ``live()``, asked
every ``LIVENESS_INTERVAL`` seconds on the waiting thread, looks (the in-process
handler reads the row; the API runner renews through the API). The moment the lease
is gone, the runtime stops or ``turn_timeout`` passes, the turn is fenced (no tool
call does anything from then on) and ``session/cancel`` is sent; an agent that does
not end a cancelled turn within ``CANCEL_GRACE`` seconds is stopped.

The verdict (``verdict``): ``end_turn`` finished, or failed with the reason if the
agent called the ``fail`` tool; ``refusal``, ``max_tokens`` and ``max_turn_requests``
failed with the reason kept, never retried; a dead agent, a protocol error, a timeout
or a turn cancelled by the agent itself retried, the error kept.

The tools (``tools_server``): ``read_message``, ``reply(content, to)`` and
``fail(reason)``; each runs on the waiting thread, through the turn's ``effects``
(what the lease's holder can do: the database under ``holding()``, or the API)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from ..exceptions import LeaseNotLive, ProtocolError, WorkflowDeliveryError
from ..protocol import DeliveryRecord, MessageEvent
from .runtime import AgentError, AgentRuntime, Turn

__all__ = [
    "CANCEL_GRACE",
    "FAILED_STOP_REASONS",
    "LIVENESS_INTERVAL",
    "LeaseSource",
    "TurnTimeout",
    "Verdict",
    "drive",
    "note_failure",
    "prompt_blocks",
    "reply_key",
    "tools_server",
    "verdict",
]

logger = logging.getLogger(__name__)

# How long a cancelled turn may take to end before the agent is stopped.
CANCEL_GRACE = 3.0
# How often the waiting thread asks the lease source whether the lease still lives.
LIVENESS_INTERVAL = 0.5
# The longest the waiting thread sleeps between looks at ``lost``, ``stopping`` and
# the turn's deadlines; a tool's work or the turn's end wakes it at once.
POLL = 0.02
FAILED_STOP_REASONS = frozenset({"refusal", "max_tokens", "max_turn_requests"})


class TurnTimeout(AgentError):
    """The turn ran past the runtime's turn timeout; it was cancelled, the delivery
    is retried."""


class LeaseSource(Protocol):
    """Where the turn's lease lives (see the module's docstring)."""

    lost: threading.Event
    stopping: threading.Event

    def live(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a turn that ended under a live lease settles: ``finished``; ``failed``
    with ``reason`` (never retried); or ``retry`` with ``error`` kept."""

    settle: str
    reason: str | None = None
    error: AgentError | None = None


def reply_key(content: object, to: object) -> str:
    """A reply's idempotency key: the digest of its arguments, so the same tool call
    asked again sends once."""
    keys = sorted(key.lower() for key in to) if isinstance(to, list) else to
    arguments = json.dumps([content, keys], default=str)
    return hashlib.sha256(arguments.encode()).hexdigest()


def note_failure(effects: Any, reason: object) -> str:
    """The ``fail`` tool: keep the reason on ``effects``; the turn's end settles the
    delivery failed."""
    if not isinstance(reason, str) or not reason.strip():
        raise ProtocolError("reason", "must be a non-empty string")
    effects.failure = reason[:1000]
    return "the delivery will be settled failed when the turn ends"


def add_turn_options(parser: Any) -> None:
    """The options both commands take for the turns they run (an ``argparse`` parser)."""
    parser.add_argument("--lease-seconds", type=int, default=30, help="default %(default)s")
    parser.add_argument("--concurrency", type=int, default=1, help="turns in flight at most")
    parser.add_argument("--max-deliveries", type=int, help="stop after this many")
    parser.add_argument("--turn-timeout", type=float, help="seconds before a turn is cancelled")
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="seconds the agent has to answer initialize (default %(default)s)",
    )


def read_document(record: DeliveryRecord, message: MessageEvent, replies: list[Any]) -> dict:
    """What ``read_message`` answers: the delivery, its run and step, the message and
    the run's replies so far (from whichever lease source holds the turn)."""
    binding = record.binding
    return {
        "delivery_id": str(record.id),
        "run_id": str(binding.run_id),
        "step_id": binding.step_id,
        "message": {
            "id": message.id.hex(),
            "pubkey": message.pubkey.hex(),
            "content": message.content,
            "tags": message.tags,
        },
        "replies": replies,
    }


def prompt_blocks(record: DeliveryRecord, message: MessageEvent) -> list[Any]:
    """``session/prompt``'s content: the message's text, then the delivery, run and
    message ids as an embedded resource."""
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
    content = message.content if isinstance(message.content, str) else json.dumps(message.content)
    return [text_block(content), resource_block(resource)]


def tools_server(runtime_turn: Any) -> Any:
    """The MCP server offered to every session. ``runtime_turn(token)`` finds the
    turn in progress in the session the bearer token was given to; the turn's
    ``effects`` has ``read()``, ``reply(content, to)`` and ``fail(reason)``."""
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


def drive(
    runtime: AgentRuntime,
    turn: Turn,
    source: LeaseSource,
    *,
    turn_timeout: float | None = None,
    cancelled_at: list[float] | None = None,
) -> str | None:
    """Prompt the agent with ``turn`` and wait for it on this thread, doing its
    tools' work; the reason it was cancelled (``lost``, ``stopping``, ``timeout``),
    if it was. ``cancelled_at`` collects the instants a cancel was sent."""
    future = turn.result = runtime.turn(turn)
    # The turn's end wakes this thread at once; the poll below only bounds how long
    # a lost lease, a stop or a timeout waits to be seen.
    future.add_done_callback(lambda _: turn.wake())
    started = time.monotonic()
    next_check = started + LIVENESS_INTERVAL
    why: str | None = None
    cancel_deadline = 0.0
    try:
        while not future.done():
            turn.run_jobs(POLL)
            now = time.monotonic()
            if why is None:
                if source.lost.is_set():
                    why = "lost"
                elif source.stopping.is_set():
                    why = "stopping"
                elif turn_timeout is not None and now - started > turn_timeout:
                    why = "timeout"
                elif now >= next_check:
                    if not source.live():
                        source.lost.set()
                        why = "lost"
                    next_check = time.monotonic() + LIVENESS_INTERVAL
                if why is not None:
                    if cancelled_at is not None:
                        cancelled_at.append(time.monotonic())
                    logger.info("cancelling the turn of %s: %s", turn.delivery_id, why)
                    runtime.cancel(turn)
                    cancel_deadline = time.monotonic() + CANCEL_GRACE
            elif now > cancel_deadline:
                logger.warning("the agent did not end the cancelled turn; stopping it")
                runtime.abandon(turn)
                break
    finally:
        turn.close()
    return why


def verdict(turn: Turn, why: str | None, turn_timeout: float | None = None) -> Verdict:
    """How the turn settles, for a turn that ended (or timed out) under a live
    lease; sets ``turn.stop_reason``. ``turn.effects.failure`` is the reason the
    ``fail`` tool gave, if it was called."""
    if why == "timeout":
        return Verdict(
            "retry", error=TurnTimeout(f"the turn ran past {turn_timeout:g} s and was cancelled")
        )
    try:
        stop_reason = turn.result.result(timeout=0)
    except AgentError as exc:
        return Verdict("retry", error=exc)
    except Exception as exc:  # noqa: BLE001 - any failure of the turn is the agent's
        return Verdict("retry", error=AgentError(f"the turn failed: {exc!r}"))
    turn.stop_reason = stop_reason
    if stop_reason == "end_turn":
        failure = getattr(turn.effects, "failure", None)
        if failure:
            return Verdict("failed", reason=f"the agent failed it: {failure}")
        return Verdict("finished")
    if stop_reason in FAILED_STOP_REASONS:
        return Verdict("failed", reason=f"the agent stopped the turn: {stop_reason}")
    return Verdict("retry", error=AgentError(f"the agent ended the turn {stop_reason!r} unasked"))
