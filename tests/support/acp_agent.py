"""A scripted ACP agent for the tests: a real program on the agent side of the
``agent-client-protocol`` SDK, whose behaviour a test chooses.

Per turn, the first word of the prompt's first text block picks what it does:

``answer`` (or anything else)
    says "ok: <the rest>" in one chunk, ends the turn (``end_turn``);
``stream N``
    says N chunks, then ``end_turn``;
``transcript N``
    a turn for the transcript: says N chunks holding HTML (``<b>part i</b> & ``),
    reports two tool calls (``read <notes>``, kind read: pending, in progress,
    completed; ``edit config``, kind edit: failed), asks permission for
    ``delete <everything>`` (kind delete), says which option it was given and
    ``done``, then ``end_turn``;
``reply <hex>[,<hex>] <text>``
    calls the session's MCP ``reply`` tool (a real MCP client session to the server
    that ``session/new`` named) with ``<text>`` to those keys, reports the tool call,
    then ``end_turn``; ``reply-twice`` calls it twice with the same arguments;
``fail <reason>``
    calls the MCP ``fail`` tool, then ``end_turn``;
``read``
    calls ``read_message`` and says what it returned;
``hang``
    waits until ``session/cancel``, then ends the turn ``cancelled``; ``hang-reply``
    waits, and replies through MCP once cancelled (a late effect to be refused);
``sleep S``
    works for S seconds, then ``end_turn`` (a long turn);
``crash``
    says a chunk, then the process exits at once (mid-turn);
``refuse`` / ``max_tokens`` / ``max_turn_requests``
    ends the turn with that stop reason;
``permission``
    asks ``session/request_permission`` and says which option it was given;
``malformed``
    writes a line that is not JSON on stdout, then waits for ``session/cancel``.

The environment chooses what the process does as a whole (``ACP_AGENT_MODE``):
``exit`` exits before reading anything; ``bad-version`` answers ``initialize`` with a
protocol version the client does not speak; ``mute`` never answers ``initialize``.
``ACP_AGENT_DELAY`` seconds are spent before and after each reply (for the chaos
test to kill it between the two). ``ACP_AGENT_LOG``, when set, is a file each turn
appends one line to (``pid word``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from typing import Any

import httpx2
from acp import (
    PROTOCOL_VERSION,
    InitializeResponse,
    NewSessionResponse,
    PromptResponse,
    run_agent,
    start_tool_call,
    update_agent_message_text,
    update_tool_call,
)
from acp.interfaces import Client
from acp.schema import AgentCapabilities, PermissionOption
from mcp import Client as McpClient
from mcp.client.streamable_http import streamable_http_client


class ScriptedAgent:
    def __init__(self) -> None:
        self._conn: Client | None = None
        self._servers: dict[str, Any] = {}
        self._cancelled: dict[str, asyncio.Event] = {}

    def on_connect(self, conn: Client) -> None:
        self._conn = conn

    async def initialize(self, protocol_version: int, **kwargs: Any) -> InitializeResponse:
        if os.environ.get("ACP_AGENT_MODE") == "mute":
            await asyncio.Event().wait()
        version = (
            PROTOCOL_VERSION + 41
            if os.environ.get("ACP_AGENT_MODE") == "bad-version"
            else (PROTOCOL_VERSION)
        )
        return InitializeResponse(protocol_version=version, agent_capabilities=AgentCapabilities())

    async def new_session(self, cwd: str, mcp_servers: list | None = None, **kwargs: Any):
        session_id = uuid.uuid4().hex
        self._servers[session_id] = (mcp_servers or [None])[0]
        self._cancelled[session_id] = asyncio.Event()
        return NewSessionResponse(session_id=session_id)

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self._cancelled[session_id].set()

    async def _say(self, session_id: str, text: str) -> None:
        await self._conn.session_update(session_id, update_agent_message_text(text))

    async def _call(self, session_id: str, tool: str, arguments: dict) -> str:
        server = self._servers[session_id]
        headers = {header.name: header.value for header in server.headers}
        call_id = uuid.uuid4().hex
        await self._conn.session_update(
            session_id, start_tool_call(call_id, f"{tool} via MCP", kind="other", status="pending")
        )
        async with (
            httpx2.AsyncClient(headers=headers, timeout=30) as http,
            McpClient(streamable_http_client(server.url, http_client=http)) as client,
        ):
            result = await client.call_tool(tool, arguments)
        text = " ".join(getattr(block, "text", "") for block in result.content)
        status = "failed" if result.is_error else "completed"
        await self._conn.session_update(session_id, update_tool_call(call_id, status=status))
        return ("error: " if result.is_error else "") + text

    async def _transcript(self, session_id: str, chunks: int) -> None:
        for index in range(chunks):
            await self._say(session_id, f"<b>part {index}</b> & ")
        update = self._conn.session_update
        await update(session_id, start_tool_call("t1", "read <notes>", kind="read"))
        await update(session_id, update_tool_call("t1", status="in_progress"))
        await update(session_id, update_tool_call("t1", status="completed"))
        await update(session_id, start_tool_call("t2", "edit config", kind="edit"))
        await update(session_id, update_tool_call("t2", status="failed"))
        answer = await self._conn.request_permission(
            options=[
                PermissionOption(option_id="yes", name="Allow", kind="allow_once"),
                PermissionOption(option_id="no", name="Reject", kind="reject_once"),
            ],
            session_id=session_id,
            tool_call=update_tool_call("t3", title="delete <everything>", kind="delete"),
        )
        await self._say(session_id, f"given {getattr(answer.outcome, 'option_id', None)}; done")

    async def prompt(self, prompt: list, session_id: str, **kwargs: Any) -> PromptResponse:
        text = next((block.text for block in prompt if getattr(block, "type", "") == "text"), "")
        word, _, rest = text.strip().partition(" ")
        cancelled = self._cancelled[session_id]
        cancelled.clear()
        log = os.environ.get("ACP_AGENT_LOG")
        if log:
            with open(log, "a") as handle:
                handle.write(f"{os.getpid()} {word}\n")
        if word == "stream":
            for index in range(int(rest or 3)):
                await self._say(session_id, f"chunk {index} ")
        elif word == "transcript":
            await self._transcript(session_id, int(rest or 3))
        elif word in ("reply", "reply-twice"):
            keys, _, content = rest.partition(" ")
            arguments = {"content": content, "to": [key for key in keys.split(",") if key]}
            delay = float(os.environ.get("ACP_AGENT_DELAY", "0"))
            for _ in range(2 if word == "reply-twice" else 1):
                await asyncio.sleep(delay)
                await self._say(session_id, await self._call(session_id, "reply", arguments))
            await asyncio.sleep(delay)
        elif word == "fail":
            await self._say(session_id, await self._call(session_id, "fail", {"reason": rest}))
        elif word == "read":
            await self._say(session_id, await self._call(session_id, "read_message", {}))
        elif word in ("hang", "hang-reply", "malformed"):
            if word == "malformed":
                sys.stdout.write("{this is not json\n")
                sys.stdout.flush()
            await cancelled.wait()
            if word == "hang-reply":
                await self._call(session_id, "reply", {"content": "late", "to": [rest]})
            return PromptResponse(stop_reason="cancelled")
        elif word == "sleep":
            await asyncio.sleep(float(rest))
        elif word == "crash":
            await self._say(session_id, "about to crash")
            await asyncio.sleep(0.05)
            os._exit(3)
        elif word in ("refuse", "max_tokens", "max_turn_requests"):
            await self._say(session_id, f"stopping: {word}")
            reason = "refusal" if word == "refuse" else word
            return PromptResponse(stop_reason=reason)
        elif word == "permission":
            answer = await self._conn.request_permission(
                options=[
                    PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                    PermissionOption(option_id="deny", name="Deny", kind="reject_once"),
                ],
                session_id=session_id,
                tool_call=update_tool_call("perm-1", title=rest or "write a file", kind="edit"),
            )
            await self._say(session_id, f"permission: {json.dumps(answer.outcome.model_dump())}")
        else:
            await self._say(session_id, f"ok: {text}")
        return PromptResponse(stop_reason="end_turn")


def main() -> None:
    if os.environ.get("ACP_AGENT_MODE") == "exit":
        sys.stderr.write("scripted agent: exiting at start\n")
        sys.exit(2)
    asyncio.run(run_agent(ScriptedAgent()))


if __name__ == "__main__":
    main()
