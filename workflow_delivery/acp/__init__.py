"""The ACP runtime: drives an agent speaking the Agent Client Protocol over stdio for
one enrolled agent key, each claimed delivery one turn, with lease-fenced replies
over MCP. ``run_acp_agent`` (below, and the command of the same name) puts the
pieces together: an ``AgentRuntime`` (the asyncio side), an ``AcpHandler`` (the
thread side) and a ``Consumer`` (the claiming)."""

from __future__ import annotations

from .handler import AcpHandler, TurnTimeout, tools_server
from .runtime import AgentError, AgentRuntime, AgentStartError, Turn
from .service import AcpAgent

__all__ = [
    "AcpAgent",
    "AcpHandler",
    "AgentError",
    "AgentRuntime",
    "AgentStartError",
    "Turn",
    "TurnTimeout",
    "tools_server",
]
