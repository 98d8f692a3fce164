"""The asyncio side of the ACP runtime: one event loop thread that owns the agent
process, its ACP connection, its sessions, and the MCP server offered to them.

Threads and the loop: the ``Consumer`` runs handlers in worker threads, while the
``agent-client-protocol`` and ``mcp`` SDKs are asyncio. ``AgentRuntime`` keeps one
loop in a thread of its own; a handler hands it a ``Turn`` and waits on the
``concurrent.futures.Future`` it gets back. Nothing on the loop touches the database:
an MCP tool that must write (a reply) puts the work on its turn's ``jobs`` queue, and
the handler's thread, which holds the lease and the Django connection, runs it and
answers through a future. So every database write happens on the thread that owns
the lease, inside ``holding()``.

One agent process serves every turn; it is spawned at ``start()`` (a command that
does not exist, exits at once, never answers ``initialize`` or speaks another
protocol version is an ``AgentStartError`` there) and spawned again before the next
turn once it has died. Sessions map to runs: the first turn of a run opens an ACP
session (``session/new``, with this runtime's MCP server in ``mcpServers``), later
turns of the same run prompt the same session, so a run's later steps keep their
context. A restarted agent has no sessions: the next turn of a run opens a new one.
Turns of one session run one at a time.

The MCP server is a Streamable HTTP server on 127.0.0.1 (an ephemeral port), served
by uvicorn on the same loop: the agent connects to it as to any HTTP MCP server, no
process of ours is spawned per session, and a tool call reaches the turn's state
directly. Each session is given its own bearer token in the server's headers; the
token names the session, and so the turn in progress, and a call without one, or
for a session with no turn in progress, is a tool error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from ..exceptions import WorkflowDeliveryError

__all__ = ["AgentError", "AgentRuntime", "AgentStartError", "Turn"]

logger = logging.getLogger(__name__)

# Sessions remembered per agent process; the oldest run's session is forgotten first.
MAX_SESSIONS = 256
MCP_SERVER_NAME = "workflow-delivery"
# Tool calls, and permission requests, a turn keeps at most (the rest is not noted),
# and the longest string of one it keeps.
MAX_ENTRIES = 200
MAX_FIELD = 300


def _clip(value: object) -> str:
    return str(value)[:MAX_FIELD]


class AgentError(WorkflowDeliveryError):
    """The agent failed a turn: its process died, or it broke the protocol. The
    delivery is retried."""


class AgentStartError(AgentError):
    """The agent command could not be started and initialised: it does not exist,
    exits at once, never answers ``initialize``, or speaks another protocol version."""


@dataclass
class Turn:
    """One delivery handed to the agent, shared by the handler's thread and the loop.

    ``blocks`` is the ``session/prompt`` content. The loop appends what the agent
    says to ``chunks`` (at most ``max_bytes`` of text; ``said`` counts every byte it
    said, so ``truncated`` tells a cut text), and summaries of its tool calls (by id,
    their latest title, kind and status) and of its permission requests (what was
    asked, the options, the policy's answer), at most ``MAX_ENTRIES`` of each. Once
    ``fenced`` is set (the lease is gone, the turn timed out or the runtime stops)
    no tool call of the turn does anything."""

    run_id: UUID
    delivery_id: UUID
    blocks: list[Any]
    max_bytes: int
    chunks: list[str] = field(default_factory=list)
    size: int = 0
    said: int = 0
    tool_calls: dict[str, dict[str, str | None]] = field(default_factory=dict)
    permissions: list[dict[str, Any]] = field(default_factory=list)
    fenced: threading.Event = field(default_factory=threading.Event)
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    session_id: str | None = None
    #: What the handler's side attaches: the tools' effects, the turn's future and
    #: the stop reason the agent gave.
    effects: Any = None
    result: concurrent.futures.Future | None = None
    stop_reason: str | None = None
    _open: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        encoded = text.encode()
        cut = self.truncated
        self.said += len(encoded)
        if cut:
            return  # the kept text is a prefix of what was said: nothing after a cut
        room = self.max_bytes - self.size
        if len(encoded) > room:
            # Cut on a character boundary: a split character is left out whole.
            text = encoded[: max(0, room)].decode(errors="ignore")
        self.size += len(text.encode())
        if text:
            self.chunks.append(text)

    @property
    def truncated(self) -> bool:
        return self.said > self.size

    def tool_call(
        self, call_id: str, *, title: Any = None, kind: Any = None, status: Any = None
    ) -> None:
        """Note a tool call, or what an update of it changes."""
        entry = self.tool_calls.get(call_id)
        if entry is None:
            if len(self.tool_calls) >= MAX_ENTRIES:
                return
            entry = self.tool_calls[call_id] = {
                "id": _clip(call_id),
                "title": None,
                "kind": None,
                "status": "pending",
            }
        for name, value in (("title", title), ("kind", kind), ("status", status)):
            if value is not None:
                entry[name] = _clip(getattr(value, "value", value))

    def permission(
        self, title: str, kind: str, options: list[str], answer: str, option: str | None
    ) -> None:
        if len(self.permissions) < MAX_ENTRIES:
            self.permissions.append(
                {
                    "title": _clip(title),
                    "kind": _clip(kind),
                    "options": [_clip(name) for name in options[:10]],
                    "answer": answer,
                    "option": None if option is None else _clip(option),
                }
            )

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def call(self, work: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``work`` on the handler's thread; the future answers it. A turn that
        is over, or fenced, refuses at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._open or self.fenced.is_set():
                future.set_exception(AgentError("the turn is over: nothing is done"))
                return future
            self.jobs.put((work, future))
        return future

    def wake(self) -> None:
        """Wake the handler's thread out of ``run_jobs`` now (the turn's future is
        done: it need not wait out its poll)."""
        self.jobs.put((None, None))

    def run_jobs(self, timeout: float) -> None:
        """On the handler's thread: run the work the loop asked for, waiting up to
        ``timeout`` for the first, or until ``wake()``."""
        try:
            work, future = self.jobs.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            if work is None:
                pass  # a wake-up: nothing to run
            elif self.fenced.is_set():
                future.set_exception(AgentError("the lease is gone: nothing is done"))
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - answered to the tool
                    future.set_exception(exc)
            try:
                work, future = self.jobs.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """The handler is done with the turn: later calls are refused, waiting ones
        answered."""
        with self._lock:
            self._open = False
        while True:
            try:
                _, future = self.jobs.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(AgentError("the turn is over: nothing is done"))


@dataclass
class _Session:
    session_id: str
    token: str
    lock: asyncio.Lock
    turn: Turn | None = None


class _Client:
    """The client side the agent talks to: session updates and permission requests."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.runtime = runtime

    def _turn(self, session_id: str) -> Turn | None:
        session = self.runtime._by_id.get(session_id)
        return session.turn if session is not None else None

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        turn = self._turn(session_id)
        if turn is None:
            return
        kind = getattr(update, "session_update", "")
        if kind == "agent_message_chunk":
            text = getattr(update.content, "text", None)
            if text is not None:
                turn.say(text)
        elif kind in ("tool_call", "tool_call_update"):
            turn.tool_call(
                update.tool_call_id,
                title=getattr(update, "title", None),
                kind=getattr(update, "kind", None),
                status=getattr(update, "status", None),
            )

    async def request_permission(
        self, options: list[Any], session_id: str, tool_call: Any, **kwargs: Any
    ) -> Any:
        from acp.schema import AllowedOutcome, DeniedOutcome, RequestPermissionResponse

        title = getattr(tool_call, "title", None) or tool_call.tool_call_id
        kind = getattr(tool_call, "kind", None) or "other"
        kind = getattr(kind, "value", kind)
        allowed = kind in self.runtime.allow or title in self.runtime.allow
        wanted = ("allow_once", "allow_always") if allowed else ("reject_once", "reject_always")
        chosen = next((option for option in options if option.kind in wanted), None)
        turn = self._turn(session_id)
        verdict = "allowed" if allowed and chosen else "denied"
        if turn is not None:
            turn.permission(
                title,
                kind,
                [f"{option.name} ({option.kind})" for option in options],
                verdict,
                chosen.option_id if chosen is not None else None,
            )
        if chosen is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=chosen.option_id)
        )

    async def write_text_file(self, *args: Any, **kwargs: Any) -> Any:
        raise _method_not_found("fs/write_text_file")

    async def read_text_file(self, *args: Any, **kwargs: Any) -> Any:
        raise _method_not_found("fs/read_text_file")

    async def create_terminal(self, *args: Any, **kwargs: Any) -> Any:
        raise _method_not_found("terminal/create")

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise _method_not_found(method)

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None

    def on_connect(self, conn: Any) -> None:
        return None


def _method_not_found(method: str) -> Exception:
    from acp import RequestError

    return RequestError.method_not_found(method)


class AgentRuntime:
    """Drives one ACP agent command for many turns (see the module's docstring).

    ``start()`` and ``close()`` from the owning thread; ``turn()``, ``cancel()`` and
    ``abandon()`` from any thread. ``allow``: the tool kinds or titles whose
    permission requests are allowed; every other request is denied.
    ``tools_server``: an ``mcp`` ``MCPServer`` offered to every session."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        handshake_timeout: float = 10.0,
        allow: Sequence[str] = (),
        tools_server: Any = None,
    ) -> None:
        if not command:
            raise AgentStartError("the agent command is empty")
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd or os.getcwd()
        self.handshake_timeout = handshake_timeout
        self.allow = frozenset(allow)
        self.restarts = 0
        self.mcp_url = ""
        self.tools_server = tools_server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="acp-runtime", daemon=True)
        self._sessions: OrderedDict[UUID, _Session] = OrderedDict()
        self._by_id: dict[str, _Session] = {}
        self._by_token: dict[str, _Session] = {}
        self._conn: Any = None
        self._process: Any = None
        self._spawn: Any = None
        self._agent_lock: asyncio.Lock | None = None
        self._server: Any = None
        self._server_task: asyncio.Task | None = None

    # -- owning thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        try:
            self._submit(self._start()).result()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._submit(self._close()).result(timeout=15)
        except Exception:
            logger.warning("closing the agent runtime failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- any thread -------------------------------------------------------------------

    def turn(self, turn: Turn) -> concurrent.futures.Future:
        """Prompt the agent with ``turn``; the future answers its stop reason, or
        raises ``AgentError``."""
        return self._submit(self._turn(turn))

    def cancel(self, turn: Turn) -> None:
        """Fence the turn and send ``session/cancel`` for it."""
        turn.fenced.set()
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._cancel(turn)))

    def abandon(self, turn: Turn) -> None:
        """The agent did not end a cancelled turn: stop its process (the next turn
        starts another)."""
        turn.fenced.set()
        self._submit(self._stop_agent("it did not end a cancelled turn"))

    def _submit(self, coroutine: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    # -- the loop -----------------------------------------------------------------------

    async def _start(self) -> None:
        self._agent_lock = asyncio.Lock()
        if self.tools_server is not None:
            await self._serve_mcp()
        async with self._agent_lock:
            await self._spawn_agent()

    async def _serve_mcp(self) -> None:
        import uvicorn

        app = self.tools_server.streamable_http_app(stateless_http=True, json_response=True)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._server_task = self._loop.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()
            await asyncio.sleep(0.01)
        self.mcp_url = f"http://127.0.0.1:{port}/mcp"

    async def _spawn_agent(self) -> None:
        from acp import PROTOCOL_VERSION, spawn_agent_process
        from acp.schema import ClientCapabilities, Implementation

        spawn = spawn_agent_process(
            _Client(self),
            self.command[0],
            *self.command[1:],
            env=self.env,
            cwd=self.cwd,
            # The agent's stderr goes where ours goes: an unread pipe would block it.
            transport_kwargs={"stderr": None},
        )
        try:
            conn, process = await spawn.__aenter__()
        except OSError as exc:
            raise AgentStartError(f"cannot start the agent {self.command[0]!r}: {exc}") from exc
        self._spawn, self._conn, self._process = spawn, conn, process
        try:
            answer = await asyncio.wait_for(
                conn.initialize(
                    protocol_version=PROTOCOL_VERSION,
                    client_capabilities=ClientCapabilities(),
                    client_info=Implementation(name="workflow-delivery", version="1"),
                ),
                self.handshake_timeout,
            )
        except TimeoutError:
            await self._stop_agent("no answer to initialize")
            raise AgentStartError(
                f"the agent {self.command[0]!r} did not answer initialize within "
                f"{self.handshake_timeout:g} s"
            ) from None
        except Exception as exc:
            # The connection may close a moment before the process has exited: its own
            # exit status, given a second to come, says more than the one a stop gives.
            try:
                code = await asyncio.wait_for(process.wait(), 1.0)
            except TimeoutError:
                code = process.returncode
            await self._stop_agent("initialize failed")
            if code is None:
                code = process.returncode
            raise AgentStartError(
                f"the agent {self.command[0]!r} failed to initialise "
                f"(exit status {code}): {exc or type(exc).__name__}"
            ) from exc
        if answer.protocol_version != PROTOCOL_VERSION:
            await self._stop_agent("wrong protocol version")
            raise AgentStartError(
                f"the agent {self.command[0]!r} speaks ACP protocol version "
                f"{answer.protocol_version}; this runtime speaks {PROTOCOL_VERSION}"
            )
        logger.info("agent %s started (pid %s)", self.command[0], process.pid)

    async def _stop_agent(self, why: str) -> None:
        spawn, process = self._spawn, self._process
        self._spawn = self._conn = self._process = None
        for session in self._sessions.values():
            self._by_id.pop(session.session_id, None)
            self._by_token.pop(session.token, None)
        self._sessions.clear()
        if spawn is None:
            return
        logger.info("stopping the agent (pid %s): %s", process.pid, why)
        if process.returncode is None:
            process.kill()
        try:
            await spawn.__aexit__(None, None, None)
        except Exception:
            logger.debug("closing the agent's connection failed", exc_info=True)

    async def _agent(self) -> Any:
        """The live connection, after starting the agent again if it died."""
        async with self._agent_lock:
            if self._process is not None and self._process.returncode is not None:
                await self._stop_agent(f"it exited with status {self._process.returncode}")
            if self._conn is None:
                self.restarts += 1
                await self._spawn_agent()
            return self._conn

    async def _session(self, conn: Any, run_id: UUID) -> _Session:
        from acp.schema import HttpHeader, HttpMcpServer

        session = self._sessions.get(run_id)
        if session is not None:
            self._sessions.move_to_end(run_id)
            return session
        token = secrets.token_urlsafe(24)
        servers = []
        if self.mcp_url:
            servers.append(
                HttpMcpServer(
                    type="http",
                    name=MCP_SERVER_NAME,
                    url=self.mcp_url,
                    headers=[HttpHeader(name="Authorization", value=f"Bearer {token}")],
                )
            )
        answer = await conn.new_session(cwd=self.cwd, mcp_servers=servers)
        session = _Session(answer.session_id, token, asyncio.Lock())
        self._sessions[run_id] = session
        self._by_id[session.session_id] = session
        self._by_token[token] = session
        while len(self._sessions) > MAX_SESSIONS:
            _, old = self._sessions.popitem(last=False)
            self._by_id.pop(old.session_id, None)
            self._by_token.pop(old.token, None)
        return session

    def turn_for_token(self, token: str) -> Turn | None:
        """The turn in progress in the session ``token`` was given to (on the loop)."""
        session = self._by_token.get(token)
        return session.turn if session is not None else None

    async def _turn(self, turn: Turn) -> str:
        try:
            conn = await self._agent()
            session = await self._session(conn, turn.run_id)
        except AgentError:
            raise
        except Exception as exc:
            await self._stop_agent(f"session/new failed: {exc}")
            raise AgentError(f"the agent could not open a session: {exc}") from exc
        async with session.lock:
            session.turn = turn
            turn.session_id = session.session_id
            try:
                answer = await conn.prompt(session_id=session.session_id, prompt=turn.blocks)
            except Exception as exc:
                process = self._process
                status = None
                if process is not None:
                    # A dead agent's status, if it is dying: what the error reports.
                    with contextlib.suppress(asyncio.TimeoutError):
                        status = await asyncio.wait_for(process.wait(), 0.5)
                await self._stop_agent(f"the turn failed: {exc!r}")
                raise AgentError(
                    f"the agent failed the turn (exit status {status}): {exc or type(exc).__name__}"
                ) from exc
            finally:
                session.turn = None
        return str(answer.stop_reason)

    async def _cancel(self, turn: Turn) -> None:
        if self._conn is None or turn.session_id is None:
            return
        try:
            await self._conn.cancel(session_id=turn.session_id)
        except Exception:
            logger.debug("session/cancel not sent", exc_info=True)

    async def _close(self) -> None:
        if self._agent_lock is not None:
            await self._stop_agent("the runtime stops")
        if self._server is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._server_task, 5)
            except Exception:
                logger.debug("the MCP server did not stop cleanly", exc_info=True)
