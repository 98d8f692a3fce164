"""The workflows' and runs' admin: browsable, read only."""

from __future__ import annotations

from django.contrib import admin

from ..models import Workflow, WorkflowRun
from .shared import ReadOnlyAdmin, community_link, hex_field, workflow_link


@admin.register(Workflow)
class WorkflowAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        community_link,
        "status",
        hex_field("owner_pubkey", short=True),
        "created_at",
        "updated_at",
    ]
    list_filter = ["status", "community"]
    list_select_related = ["community"]
    search_fields = ["name"]
    uuid_search_fields = ("id",)
    hex_search_fields = ("owner_pubkey", "definition_event_id")
    search_help_text = "A name, a workflow id, or a 64-hex owner or definition event id."
    fields = [
        "id",
        community_link,
        "name",
        "status",
        hex_field("owner_pubkey"),
        "definition",
        hex_field("definition_event_id"),
        "created_at",
        "updated_at",
    ]


@admin.register(WorkflowRun)
class WorkflowRunAdmin(ReadOnlyAdmin):
    list_display = ["id", workflow_link, community_link, "status", "created_at", "updated_at"]
    list_filter = ["status", "community"]
    list_select_related = ["community", "workflow"]
    search_fields = ["status"]
    uuid_search_fields = ("id", "workflow_id")
    search_help_text = "A run id or a workflow id."
    fields = [
        "id",
        community_link,
        workflow_link,
        "status",
        hex_field("definition_event_id"),
        "created_at",
        "updated_at",
    ]
