"""Serve the admin and run the reaper loop beside it, in one process, until SIGINT/SIGTERM.

One process rather than two under a shell: its own signal handlers work even where
the shell started it with SIGINT ignored, and the embedded database's handle is
released by a normal exit.
"""

from __future__ import annotations

import logging
import threading
from argparse import ArgumentParser
from typing import Any

from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.management.base import BaseCommand, CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler

from buzz_project.demo import data as demo
from workflow_delivery.api.wake import hub as wake_hub
from workflow_delivery.commandline import log_level, positive, stop_on_signals
from workflow_delivery.conf import app_settings
from workflow_delivery.reaper import Reaper


class _QuietAgentPolls(logging.Filter):
    """Drops the access-log line of each empty claim or wait of the simulated HTTP
    agents (a 204 every second per agent); every other request is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        polled = getattr(record, "status_code", None) == 204
        return not (polled and demo.API_MOUNT in str(record.args[0] if record.args else ""))


class Command(BaseCommand):
    help = (
        "Serve the Django admin (a development server, with static files) and run the "
        "reaper loop beside it, with a few simulated agents working through the agent "
        "HTTP API; SIGINT or SIGTERM stops all."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("address", nargs="?", default="127.0.0.1:8000", help="host:port")
        parser.add_argument(
            "--http-agents",
            type=int,
            default=2,
            metavar="N",
            help="simulated agents working through the agent HTTP API (0: none)",
        )
        parser.add_argument(
            "--interval",
            type=float,
            help="seconds between sweeps (default: WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, _, port = options["address"].rpartition(":")
        if not host or not port.isdigit():
            raise CommandError(f"address must be host:port, not {options['address']!r}")
        interval = options["interval"]
        if interval is None:
            interval = app_settings.REAP_INTERVAL_SECONDS
        positive("--interval", interval, whole=False)
        count = options["http_agents"]
        if not (isinstance(count, int) and count >= 0):
            raise CommandError(f"--http-agents must be zero or more, not {count!r}")
        try:
            httpd = ThreadedWSGIServer((host, int(port)), WSGIRequestHandler)
        except OSError as exc:
            raise CommandError(f"cannot serve on {options['address']}: {exc}") from exc
        # WSGIHandler itself, not the project's wsgi module: importing that runs
        # django.setup() again, which resets the logging this command just tied to
        # --verbosity.
        httpd.set_app(StaticFilesHandler(WSGIHandler()))
        server = threading.Thread(target=httpd.serve_forever, name="admin-server", daemon=True)
        server.start()
        quiet = _QuietAgentPolls()
        logging.getLogger("django.server").addFilter(quiet)
        tally = demo.AgentTally()
        halt = threading.Event()
        threads: list[threading.Thread] = []
        try:
            agents = demo.http_agents(count, _local(host), httpd.server_port) if count else []
            self.stdout.write(
                f"serving http://{host}:{httpd.server_port}/admin/; reaper every {interval:g} s; "
                f"{len(agents)} HTTP agents on {demo.API_MOUNT}; Ctrl-C stops all"
            )
            if count and not agents:
                self.stdout.write("no active demo community: no HTTP agents (run demo_deliveries)")
            with log_level(options["verbosity"]), stop_on_signals() as stop:
                # The agents stop with the reaper: on the signal, or on its error.
                threads = demo.start_agents(agents, lambda: bool(stop) or halt.is_set(), tally)
                reaper = Reaper(batch_size=app_settings.REAP_BATCH_SIZE)
                summary = reaper.loop(interval=interval, stop=stop)
        finally:
            # The agents end their current request before the server goes away.
            halt.set()
            for thread in threads:
                thread.join()
            httpd.shutdown()
            httpd.server_close()
            server.join()
            # GET v1/wait's listener, started by the first wait: it goes with the
            # server, not later with the process, when the database it listens on
            # (the embedded one) may already be gone.
            wake_hub.stop()
            logging.getLogger("django.server").removeFilter(quiet)
        self.stdout.write(f"admin server stopped; reaper {summary}")
        if agents:
            done = sorted(tally.snapshot().items())
            counts = ", ".join(f"{name} {value}" for name, value in done)
            self.stdout.write(f"HTTP agents stopped: {counts or 'nothing to do'}")


def _local(host: str) -> str:
    """The address the agents connect to: a wildcard bind is reached on loopback."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
