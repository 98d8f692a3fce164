"""The app's configuration: its name, and the system checks registered when it is ready."""

from __future__ import annotations

from django.apps import AppConfig


class WorkflowDeliveryConfig(AppConfig):
    name = "workflow_delivery"
    verbose_name = "Workflow delivery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the system checks
