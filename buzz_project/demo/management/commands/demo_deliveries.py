"""Load the demo data set (idempotent) and optionally run simulated agents against it."""

from __future__ import annotations

import os
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from buzz_project.demo import data as demo
from workflow_delivery.commandline import stop_on_signals

PASSWORD_VARIABLE = "DEMO_ADMIN_PASSWORD"


class Command(BaseCommand):
    help = (
        "Create the demo communities, workflows, runs, messages and deliveries (every cause "
        "kind in every status, some leases expired, one community quiescing) through the "
        "service API. Running it again creates nothing new. --agents N --seconds S then "
        "runs N simulated agents: consumers (workflow_delivery.consumer) whose handler "
        "fails one delivery in ten, and, from two agents on, one agent that crashes "
        "(abandons its lease)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--agents", type=int, default=0, help="simulated agents to run")
        parser.add_argument("--seconds", type=float, default=30.0, help="how long they run")
        parser.add_argument(
            "--superuser",
            metavar="USERNAME",
            help=f"create this local superuser (or reset its password) with the password "
            f"in the {PASSWORD_VARIABLE} environment variable",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        agents, seconds = options["agents"], options["seconds"]
        if agents < 0:
            raise CommandError(f"--agents must be zero or more, not {agents}")
        if agents and not seconds > 0:
            raise CommandError(f"--seconds must be a positive number, not {seconds}")
        if options["superuser"]:
            self._superuser(options["superuser"])
        report = demo.load_demo_data()
        totals = report.totals()
        self.stdout.write(
            "demo data: "
            + ", ".join(f"{count} {name}" for name, count in totals.items())
            + f" ({report.created['deliveries']} deliveries new)"
        )
        for host in report.skipped_hosts:
            self.stdout.write(f"{host} is not active: left as it is")
        for host in report.stale_hosts:
            self.stdout.write(
                f"{host} holds deliveries of an older demo's agent keys: left as it is "
                "(recreate the database to reload it)"
            )
        for host in report.quiesced_hosts:
            self.stdout.write(f"{host} moved to quiescing")
        if agents:
            self._simulate(agents, seconds, options["verbosity"])

    def _superuser(self, username: str) -> None:
        password = os.environ.get(PASSWORD_VARIABLE)
        if not password:
            raise CommandError(f"--superuser needs the password in {PASSWORD_VARIABLE}")
        created = demo.ensure_superuser(username, password)
        self.stdout.write(f"superuser {username} {'created' if created else 'password reset'}")

    def _simulate(self, count: int, seconds: float, verbosity: int) -> None:
        agents = demo.demo_agents(count)
        if not agents:
            raise CommandError("no active demo community to run agents in")
        bar = tqdm(
            total=round(seconds, 1), unit="s", desc="agents", file=sys.stderr, disable=not verbosity
        )

        def tick(elapsed: float, counts: dict[str, int]) -> None:
            bar.n = round(elapsed, 1)
            bar.set_postfix(counts, refresh=True)

        with bar, stop_on_signals() as stop:
            counts = demo.simulate_agents(agents, seconds, stop, on_tick=tick)
        ending = f"stopped by {stop.signal_name}" if stop.signal_name else "done"
        summary = ", ".join(f"{name} {value}" for name, value in sorted(counts.items()))
        self.stdout.write(f"agents {ending}: {summary or 'nothing to do'}")
