"""``AcpAgent``: the runtime as a Python API, an agent command driven for one enrolled
key of a community, each delivery claimed by the ``Consumer`` one turn."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from ..checks import E023_MSG
from ..conf import WorkflowDeliveryConfigurationError, app_settings
from ..consumer import DEFAULT_GRACE_SECONDS, DEFAULT_POLL_INTERVAL, Consumer, ConsumerStats
from ..protocol import as_bytes32
from ..validation import AGENT_TURN_TEXT_MAX_BYTES, is_transcript_bytes
from .handler import AcpHandler, tools_server
from .runtime import AgentRuntime

__all__ = ["AcpAgent"]


class AcpAgent:
    """Drive ``command`` (an ACP agent over stdio) for ``agent`` in ``community_id``.

    ``run()`` starts the agent (``AgentStartError`` if it cannot be started and
    initialised; nothing is claimed then), claims and handles deliveries until
    ``stop()``, ``stop`` returning true, or ``max_deliveries``, then stops the agent
    and returns the Consumer's counts. ``turn_timeout``: seconds a turn may run
    before it is cancelled and the delivery retried (None: no limit)."""

    def __init__(
        self,
        community_id: UUID | str,
        agent: bytes,
        command: Sequence[str],
        *,
        lease_seconds: int = 8,
        concurrency: int = 1,
        max_deliveries: int | None = None,
        turn_timeout: float | None = None,
        handshake_timeout: float = 10.0,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        listen: bool | None = None,
        env: Mapping[str, str] | None = None,
        using: str = DEFAULT_DB_ALIAS,
        on_progress: Callable[[ConsumerStats], None] | None = None,
    ) -> None:
        self.agent = as_bytes32("agent", agent)
        transcript = app_settings.ACP_TRANSCRIPT_BYTES
        if not is_transcript_bytes(transcript):
            raise WorkflowDeliveryConfigurationError(
                E023_MSG.format(bound=AGENT_TURN_TEXT_MAX_BYTES, value=transcript)
            )
        self.runtime = AgentRuntime(
            command,
            env=env,
            handshake_timeout=handshake_timeout,
            allow=tuple(app_settings.ACP_ALLOW_PERMISSIONS),
        )
        self.runtime.tools_server = tools_server(self.runtime.turn_for_token)
        self.handler = AcpHandler(self.runtime, turn_timeout=turn_timeout, using=using)
        self.consumer = Consumer(
            community_id,
            [self.agent],
            self.handler,
            lease_seconds=lease_seconds,
            concurrency=concurrency,
            poll_interval=poll_interval,
            max_deliveries=max_deliveries,
            grace_seconds=grace_seconds,
            listen=listen,
            using=using,
            on_progress=on_progress,
        )

    def stop(self) -> None:
        self.consumer.stop()

    def run(self, stop: Callable[[], bool] | None = None) -> ConsumerStats:
        self.runtime.start()
        try:
            return self.consumer.run(stop)
        finally:
            self.runtime.close()

    def __repr__(self) -> str:
        return f"AcpAgent(agent={self.agent.hex()}, command={self.runtime.command!r})"

    def counts(self) -> dict[str, Any]:
        return {"restarts": self.runtime.restarts, **vars(self.consumer.stats)}
