"""Serve the admin and run the reaper loop beside it, in one process, until SIGINT/SIGTERM.

One process rather than two under a shell: its own signal handlers work even where
the shell started it with SIGINT ignored, and the embedded database's handle is
released by a normal exit.
"""

from __future__ import annotations

import threading
from argparse import ArgumentParser
from typing import Any

from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.management.base import BaseCommand, CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler

from workflow_delivery.conf import app_settings
from workflow_delivery.runner import Reaper, log_level, positive, stop_on_signals


class Command(BaseCommand):
    help = (
        "Serve the Django admin (a development server, with static files) and run the "
        "reaper loop beside it; SIGINT or SIGTERM stops both."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("address", nargs="?", default="127.0.0.1:8000", help="host:port")
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
        self.stdout.write(
            f"serving http://{host}:{httpd.server_port}/admin/; reaper every {interval:g} s; "
            "Ctrl-C stops both"
        )
        try:
            with log_level(options["verbosity"]), stop_on_signals() as stop:
                reaper = Reaper(batch_size=app_settings.REAP_BATCH_SIZE)
                summary = reaper.loop(interval=interval, stop=stop)
        finally:
            httpd.shutdown()
            httpd.server_close()
            server.join()
        self.stdout.write(f"admin server stopped; reaper {summary}")
