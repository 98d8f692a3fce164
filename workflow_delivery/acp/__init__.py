"""The ACP runtime: drives an agent speaking the Agent Client Protocol over stdio for
one enrolled agent key, each claimed delivery one turn, with lease-fenced replies
over MCP. In process, ``AcpAgent`` (and ``manage.py run_acp_agent``) puts the pieces
together: an ``AgentRuntime`` (the asyncio side), an ``AcpHandler`` (the thread
side) and a ``Consumer`` (the claiming). Without the database, ``ApiAgent`` (and
``python -m workflow_delivery.acp``) drives the same turns with leases from the
signed HTTP API.

The names below are imported on first use, so that importing this package (as
``python -m workflow_delivery.acp`` does) loads neither Django nor a module that
needs it."""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Each name and the module it comes from.
_NAMES = {
    "AcpAgent": "service",
    "AcpHandler": "handler",
    "AgentError": "runtime",
    "AgentRuntime": "runtime",
    "AgentStartError": "runtime",
    "ApiAgent": "remote",
    "Turn": "runtime",
    "TurnTimeout": "turns",
    "tools_server": "turns",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
