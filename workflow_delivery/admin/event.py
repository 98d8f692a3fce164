"""The events' (messages') admin: browsable by their hex id, content shown read only."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Event
from .shared import HEX64, GuardedChangeList, ReadOnlyAdmin, community_link, hex_field, hex_text


class HexKeyChangeList(GuardedChangeList):
    """Links rows whose primary key is bytes by the hex form of the key."""

    def url_for_result(self, result: Model) -> str:
        opts = self.opts
        return reverse(
            f"admin:{opts.app_label}_{opts.model_name}_change",
            args=[hex_text(result.pk)],
            current_app=self.model_admin.admin_site.name,
        )


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    """Events are keyed by their 32-byte id; their admin URLs carry it as 64 hex."""

    list_display = [
        hex_field("id", short=True),
        community_link,
        "kind",
        hex_field("pubkey", short=True),
        "created_at",
    ]
    list_filter = ["kind", "community"]
    list_select_related = ["community"]
    date_hierarchy = "created_at"
    search_fields = ["content"]
    hex_search_fields = ("id", "pubkey")
    search_help_text = "A 64-hex event id or author pubkey, or words of the content."
    fields = [
        hex_field("id"),
        community_link,
        "created_at",
        "kind",
        hex_field("pubkey"),
        "content_shown",
        "tags",
    ]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return HexKeyChangeList

    @admin.display(description="content")
    def content_shown(self, event: Event) -> str | SafeString:
        """Text as it is; a JSON value indented, its keys sorted."""
        if event.content_json is None:
            return event.content
        shown = json.dumps(event.content_json, indent=2, sort_keys=True, ensure_ascii=False)
        return format_html('<pre class="wd-json">{}</pre>', shown)

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Event | None:
        if not HEX64.fullmatch(object_id):
            return None
        return self.get_queryset(request).filter(pk=bytes.fromhex(object_id)).first()

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict | None = None,
    ) -> HttpResponse:
        # The history link of the object tools needs the key in its URL form.
        extra_context = {**(extra_context or {}), "object_id_hex": object_id.lower()}
        return super().change_view(request, object_id, form_url, extra_context)
