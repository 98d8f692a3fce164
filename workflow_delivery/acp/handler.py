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

The turn itself (the prompt, the wait, the verdict, the tools) is ``turns``'s,
shared with the API runner; this module is where its lease and its tools' effects
are the database's.

The tools (``tools_server``): ``read_message`` (the message, its run and step, the
replies stored so far in the run), ``reply(content, to)`` (a message of the same run,
tagged as a reply to the delivered one, sent to the enrolled agents in ``to``,
written inside ``holding()`` so a reply under a lost lease commits nothing; its
idempotency key comes from the delivery and the call's arguments, so the same call
retried, in this turn or a later attempt, sends once) and ``fail(reason)``.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import services
from ..conf import app_settings
from ..consumer import DeliveryContext, GiveBack, PermanentFailure
from ..exceptions import LeaseNotLive
from ..protocol import (
    DeliveryRecord,
    DeliveryStatus,
    Lease,
    MessageEvent,
    Retried,
    Settled,
)
from .runtime import AgentRuntime, Turn
from .turns import (
    CANCEL_GRACE,
    TurnTimeout,
    drive,
    note_failure,
    prompt_blocks,
    read_document,
    reply_key,
    tools_server,
    verdict,
)

__all__ = ["CANCEL_GRACE", "AcpHandler", "TurnTimeout", "tools_server"]

logger = logging.getLogger(__name__)


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
        replies = services.run_replies(binding.community_id, binding.run_id, using=self.using)
        return read_document(self.record, self.message, replies)

    def reply(self, content: object, to: object) -> str:
        with self.context.holding():
            sent = services.send_reply(
                self.context.lease,
                message=self.message,
                run_id=self.record.binding.run_id,
                content=content,
                to=to,
                idempotency_key=reply_key(content, to),
                using=self.using,
            )
        self.replies.append(sent.message.id.hex())
        state = "sent" if sent.created else "already sent"
        return f"reply {sent.message.id.hex()} {state} to {len(sent.deliveries)} agent(s)"

    def fail(self, reason: object) -> str:
        return note_failure(self, reason)


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
        return drive(
            self.runtime,
            turn,
            _ConsumerLease(context, lambda: self._live(lease)),
            turn_timeout=self.turn_timeout,
            cancelled_at=self.cancelled_at,
        )

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
        found = verdict(turn, why, self.turn_timeout)
        if found.settle == "retry":
            return found.error
        if found.settle == "failed":
            return PermanentFailure(found.reason)
        return None


class _ConsumerLease:
    """The Consumer's lease as a turn's lease source: its heartbeat sets ``lost``,
    its stop ``stopping``; ``live()`` reads the row."""

    def __init__(self, context: DeliveryContext, live: Any) -> None:
        self.lost = context.lost
        self.stopping = context.stopping
        self.live = live
