from __future__ import annotations

from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo project's own app: demo data, simulated agents and ``serve_demo``.

    None of it ships with ``workflow_delivery``; a host project writes its own.
    """

    name = "buzz_project.demo"
    label = "buzz_demo"
    verbose_name = "Buzz demo"
