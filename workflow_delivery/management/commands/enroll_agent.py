"""Enroll agent keys in a community's roster, or revoke or reinstate them."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflow_delivery import services
from workflow_delivery.commandline import add_database_options, community_option, databases_option
from workflow_delivery.exceptions import (
    AgentNotEnrolled,
    CommunityNotFound,
    CommunityWriteFenced,
    ProtocolError,
)
from workflow_delivery.protocol import RosterEntry


def _pubkey(value: str) -> bytes:
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise CommandError(f"pubkey: {value!r} is not 32 bytes as 64 hex digits")
    return key


def _describe(entry: RosterEntry) -> str:
    standing = "enabled" if entry.enabled else f"revoked at {entry.revoked_at.isoformat()}"
    label = f" ({entry.label})" if entry.label else ""
    return f"{entry.pubkey.hex()}{label}: {standing}"


class Command(BaseCommand):
    help = (
        "Enroll agent keys (64 hex digits) in a community's roster, so deliveries may be "
        "committed to them and the agent API serves them; --revoke revokes them (their "
        "leases are released), --reinstate enables revoked ones again."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("community", help="the community's id or host")
        parser.add_argument("pubkeys", nargs="+", metavar="pubkey", help="agent keys, in hex")
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--revoke", action="store_true", help="revoke the keys")
        action.add_argument("--reinstate", action="store_true", help="reinstate revoked keys")
        parser.add_argument("--label", help="a name for the enrolled keys (shown in the admin)")
        parser.add_argument(
            "--operator", help="who revokes, for the delivery timeline (operator:<name>)"
        )
        add_database_options(parser, sweeping=False)

    def handle(self, *args: Any, **options: Any) -> None:
        (alias,) = databases_option(options)
        if options["label"] is not None and (options["revoke"] or options["reinstate"]):
            raise CommandError(
                "--label is for enrolling; it cannot go with --revoke or --reinstate"
            )
        community_id = community_option("community", options["community"], alias)
        keys = [_pubkey(value) for value in options["pubkeys"]]
        try:
            if options["revoke"]:
                for key in keys:
                    revocation = services.revoke_agent(
                        community_id, key, operator=options["operator"], using=alias
                    )
                    self.stdout.write(
                        f"{_describe(revocation.entry)}; {len(revocation.released)} leases released"
                    )
            elif options["reinstate"]:
                for key in keys:
                    self.stdout.write(
                        _describe(services.reinstate_agent(community_id, key, using=alias))
                    )
            else:
                entries = services.enroll_agents(
                    community_id, keys, label=options["label"], using=alias
                )
                for entry in entries:
                    self.stdout.write(_describe(entry))
        except (AgentNotEnrolled, CommunityNotFound, CommunityWriteFenced, ProtocolError) as exc:
            raise CommandError(str(exc)) from exc
