"""Drive an ACP agent command for one enrolled agent key until SIGTERM/SIGINT or
--max-deliveries: each claimed delivery one turn (workflow_delivery.acp)."""

from __future__ import annotations

import logging
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflow_delivery.acp import AcpAgent, AgentStartError
from workflow_delivery.acp.turns import add_turn_options
from workflow_delivery.commandline import (
    VERBOSITY_LEVELS,
    key_option,
    positive,
    stop_on_signals,
)
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import Community
from workflow_delivery.protocol import as_uuid

POLL_HELP = "seconds between polls when no wake-up arrives (default %(default)s)"


class Command(BaseCommand):
    help = (
        "Run an ACP agent (Agent Client Protocol over stdio) for one enrolled agent key: "
        "each delivery it claims becomes a session/prompt turn, the lease renewed while "
        "the turn runs. end_turn settles finished; refusal, max_tokens and "
        "max_turn_requests failed; a dead agent, a protocol error or --turn-timeout "
        "retried. Usage: run_acp_agent --community C --agent KEY -- <agent command>."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--community", required=True, help="community UUID or host")
        parser.add_argument("--agent", required=True, help="the agent's public key, 64 hex")
        add_turn_options(parser)
        parser.add_argument("--poll-interval", type=float, default=2.0, help=POLL_HELP)
        parser.add_argument("--database", default="default", help="database alias")
        parser.add_argument("agent_command", nargs="+", help="the ACP agent command, after --")

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        community = self._community(options["community"], using)
        agent = options["agent"]
        key_option("--agent", agent)
        positive("--lease-seconds", options["lease_seconds"], whole=True)
        positive("--concurrency", options["concurrency"], whole=True)
        positive("--poll-interval", options["poll_interval"], whole=False)
        positive("--handshake-timeout", options["handshake_timeout"], whole=False)
        if options["max_deliveries"] is not None:
            positive("--max-deliveries", options["max_deliveries"], whole=True)
        if options["turn_timeout"] is not None:
            positive("--turn-timeout", options["turn_timeout"], whole=False)
        level = VERBOSITY_LEVELS.get(options["verbosity"], logging.DEBUG)
        logging.getLogger("workflow_delivery.acp").setLevel(level)
        try:
            runner = AcpAgent(
                community,
                bytes.fromhex(agent),
                options["agent_command"],
                lease_seconds=options["lease_seconds"],
                concurrency=options["concurrency"],
                max_deliveries=options["max_deliveries"],
                turn_timeout=options["turn_timeout"],
                handshake_timeout=options["handshake_timeout"],
                poll_interval=options["poll_interval"],
                using=using,
            )
        except ProtocolError as exc:
            raise CommandError(str(exc)) from exc
        with stop_on_signals() as stop:
            try:
                stats = runner.run(stop=lambda: bool(stop))
            except AgentStartError as exc:
                raise CommandError(str(exc)) from exc
        ending = f"stopped by {stop.signal_name}" if stop.signal_name else "done"
        self.stdout.write(f"{ending}: {stats.line()} restarts={runner.runtime.restarts}")

    def _community(self, value: str, using: str) -> Any:
        try:
            community_id = as_uuid("community", value)
        except ProtocolError:
            found = Community.objects.using(using).filter(host__iexact=value).first()
            if found is None:
                raise CommandError(f"--community {value!r} is no community id or host") from None
            return found.id
        if not Community.objects.using(using).filter(id=community_id).exists():
            raise CommandError(f"--community {community_id} does not exist")
        return community_id
