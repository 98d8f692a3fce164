"""``python -m workflow_delivery.acp --api URL --secret-env VAR -- <agent command>``:
the ACP runtime over the signed HTTP API (``remote.ApiAgent``), for an agent's
machine without Django or the database (``pip install
'buzz-workflow-delivery[acp-client]'``).

Exit status: 0 after ``--max-deliveries`` or a stop by SIGTERM/SIGINT (turns in
flight cancelled, their leases released); 2 for bad arguments (a missing variable, a
bad key or URL); 1 when the API cannot be reached or refuses the key, or the agent
command cannot be started. Nothing is claimed before all of these are checked."""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from ..client import AgentClient
from ..exceptions import AgentApiError, ProtocolError

PROGRAM = "python -m workflow_delivery.acp"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=(
            "Run an ACP agent (Agent Client Protocol over stdio) for one agent key through "
            "the signed HTTP API: each delivery it claims becomes a session/prompt turn, "
            "the lease renewed while the turn runs. end_turn settles finished; refusal, "
            "max_tokens and max_turn_requests failed; a dead agent, a protocol error or "
            "--turn-timeout retried."
        ),
        usage=f"{PROGRAM} --api URL --secret-env VAR [options] -- <agent command> [args...]",
    )
    parser.add_argument("--api", required=True, help="the agent API's base URL (…/agents/)")
    parser.add_argument(
        "--secret-env",
        required=True,
        metavar="VAR",
        help="the environment variable holding the agent's secret key (64 hex or nsec)",
    )
    parser.add_argument(
        "--community-host", help="the community's host, when the URL is a shared origin"
    )
    from .turns import add_turn_options

    add_turn_options(parser)
    parser.add_argument(
        "--wait",
        type=int,
        default=10,
        help="seconds (1-60) a claim waits for a delivery (default %(default)s)",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="KIND_OR_TITLE",
        help="a tool kind or title whose permission requests are allowed (repeatable)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each turn")
    parser.add_argument("agent_command", nargs="+", help="the ACP agent command, after --")
    return parser


def _check(parsed: argparse.Namespace, parse: argparse.ArgumentParser) -> None:
    for name in ("lease_seconds", "concurrency", "max_deliveries"):
        value = getattr(parsed, name)
        if value is not None and value < 1:
            parse.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    for name in ("turn_timeout", "handshake_timeout"):
        value = getattr(parsed, name)
        if value is not None and not value > 0:
            parse.error(f"--{name.replace('_', '-')} must be positive, not {value}")
    if not 1 <= parsed.wait <= 60:
        parse.error(f"--wait must be 1 to 60 seconds, not {parsed.wait}")


class _Stop:
    """Set by the first SIGTERM/SIGINT; a second one exits at once."""

    def __init__(self) -> None:
        # A plain flag, not a threading.Event: a signal handler must take no lock.
        self.name: str | None = None

    def __bool__(self) -> bool:
        return self.name is not None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.name is not None:
            os._exit(128 + signum)
        self.name = signal.Signals(signum).name


def main(argv: Sequence[str] | None = None) -> int:
    parse = parser()
    parsed = parse.parse_args(argv)
    _check(parsed, parse)
    logging.basicConfig(
        level=logging.INFO if parsed.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    secret = os.environ.get(parsed.secret_env)
    if not secret:
        parse.error(f"--secret-env: the environment variable {parsed.secret_env} is not set")

    def client() -> AgentClient:
        return AgentClient(parsed.api, secret, community_host=parsed.community_host)

    try:
        client().close()
    except ProtocolError as exc:
        parse.error(str(exc))

    from .remote import ApiAgent
    from .runtime import AgentStartError

    runner = ApiAgent(
        client,
        parsed.agent_command,
        lease_seconds=parsed.lease_seconds,
        concurrency=parsed.concurrency,
        max_deliveries=parsed.max_deliveries,
        turn_timeout=parsed.turn_timeout,
        handshake_timeout=parsed.handshake_timeout,
        wait_seconds=parsed.wait,
        allow=parsed.allow,
    )
    stop = _Stop()
    previous = {
        signum: signal.signal(signum, stop.handle) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        stats = runner.run(stop=lambda: bool(stop))
    except (OSError, http.client.HTTPException) as exc:
        reason = f"cannot reach the agent API at {parsed.api}: {exc}"
        print(f"{PROGRAM}: error: {reason}", file=sys.stderr)
        return 1
    except AgentApiError as exc:
        print(f"{PROGRAM}: error: the agent API refused: {exc}", file=sys.stderr)
        return 1
    except AgentStartError as exc:
        print(f"{PROGRAM}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    ending = f"stopped by {stop.name}" if stop else "done"
    print(f"{ending}: {stats.line()} restarts={runner.runtime.restarts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
