"""Create a community for a host, or report the one that has it (run twice, one is made)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflow_delivery import services
from workflow_delivery.commandline import add_database_options, databases_option
from workflow_delivery.exceptions import ProtocolError


class Command(BaseCommand):
    help = (
        "Create an active community whose agents reach the API at --host (the Host "
        "header, without its port). A host taken already (in any case) creates nothing "
        "and prints that community's id and state."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", required=True, help="the community's host, e.g. acme.example")
        add_database_options(parser, sweeping=False)

    def handle(self, *args: Any, **options: Any) -> None:
        (alias,) = databases_option(options)
        try:
            result = services.create_community(options["host"], using=alias)
        except ProtocolError as exc:
            raise CommandError(str(exc)) from exc
        if result.created:
            self.stdout.write(f"created community {result.id} for {result.host}")
        else:
            self.stdout.write(
                f"community {result.id} has the host {result.host} already "
                f"({result.deletion_state}): nothing created"
            )
