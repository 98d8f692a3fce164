"""An agent's key pair: a new one, or the public key of a secret read from stdin or
the environment (never from the command line, where it would stay in shell history)."""

from __future__ import annotations

import os
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflow_delivery import keys
from workflow_delivery.exceptions import ProtocolError


class Command(BaseCommand):
    help = (
        "Print a new agent key pair (secret and x-only public key, hex), or with --public "
        "the public key of the secret read from stdin (or --secret-env NAME)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--public",
            action="store_true",
            help="print only the public key of an existing secret (read from stdin)",
        )
        parser.add_argument(
            "--secret-env",
            metavar="NAME",
            help="with --public: read the secret from this environment variable instead",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if not options["public"]:
                if options["secret_env"]:
                    raise CommandError("--secret-env goes with --public")
                secret, public = keys.new_key_pair()
                self.stdout.write(f"secret {secret}\npublic {public}")
                return
            self.stdout.write(keys.public_key(self._secret(options["secret_env"])))
        except keys.KeysUnavailable as exc:
            raise CommandError(str(exc)) from exc
        except ProtocolError as exc:
            raise CommandError(str(exc)) from exc

    def _secret(self, variable: str | None) -> str:
        if variable is None:
            line = sys.stdin.readline().strip()
            if not line:
                raise CommandError("--public reads the secret key from stdin: none was given")
            return line
        value = os.environ.get(variable, "").strip()
        if not value:
            raise CommandError(f"the environment variable {variable} is not set or empty")
        return value
