"""The communities' admin: browse them, add one by its host, and move the selected
through the deletion lifecycle (each move behind its own permission)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Model, QuerySet
from django.db.models.functions import Lower
from django.http import HttpRequest

from .. import services
from ..exceptions import CommunityNotFound, InvalidLifecycleTransition, ProtocolError
from ..models import Community, DeletionState
from ..validation import as_host
from .shared import ReadOnlyAdmin, log_operator_change, operator_permission


def lifecycle_action(
    codename: str, label: str, source: DeletionState, target: DeletionState
) -> Callable[[CommunityAdmin, HttpRequest, QuerySet], None]:
    """An action moving the selected communities in ``source`` to ``target``."""

    @admin.action(permissions=[codename], description=f"{label} ({source} → {target})")
    def action(modeladmin: CommunityAdmin, request: HttpRequest, queryset: QuerySet) -> None:
        modeladmin.move(request, queryset, source, target, label)

    return action


class CommunityAddForm(forms.ModelForm):
    """The one form of the admin that writes: a new community's host, checked as the
    service checks it, a host taken already (in any case) refused by name."""

    class Meta:
        model = Community
        fields = ["host"]
        widgets = {"host": forms.TextInput(attrs={"size": 60})}

    def clean_host(self) -> str:
        try:
            host = as_host(self.cleaned_data["host"])
        except ProtocolError as exc:
            raise ValidationError(str(exc)) from exc
        taken = (
            Community.objects.annotate(lower_host=Lower("host"))
            .filter(lower_host=host)
            .values_list("id", "deletion_state")
            .first()
        )
        if taken is not None:
            raise ValidationError(f"community {taken[0]} ({taken[1]}) has the host {host} already")
        return host

    def validate_unique(self) -> None:
        # The host's uniqueness is clean_host's (in any case); the row is the service's.
        pass


@admin.register(Community)
class CommunityAdmin(ReadOnlyAdmin):
    """Communities change state only through the fence executor. Each action moves
    rows from one state to the next (no skipping ahead) and skips every other row.
    The add form creates a community through ``services.create_community`` and
    nothing else; no existing row is ever changed here."""

    list_display = [
        "host",
        "deletion_state",
        "deletion_fence_generation",
        "deleted_at",
        "created_at",
    ]
    list_filter = ["deletion_state"]
    search_fields = ["host"]
    uuid_search_fields = ("id",)
    search_help_text = "A host, or a community id."
    fields = ["id", *list_display]
    actions = ["begin_deletion", "fence_communities", "tombstone", "cancel_deletion"]

    def move(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        source: DeletionState,
        target: DeletionState,
        label: str,
    ) -> None:
        moved = []
        for community in queryset.filter(deletion_state=source):
            try:
                # The state this page read, checked under the executor's lock: a row
                # moved on (or back) meanwhile is skipped, never moved from elsewhere.
                services.transition_community(community.pk, target, expected=source)
            except (InvalidLifecycleTransition, CommunityNotFound):
                continue  # moved on by someone else since the page was read
            moved.append(community)
        log_operator_change(
            request, Community, moved, f"{label} ({source} -> {target}) by an operator"
        )
        considered = queryset.count()
        skipped = {f"not {source}": considered - len(moved)}
        self._report(request, label, len(moved), considered, skipped)

    begin_deletion = lifecycle_action(
        "begin_community_deletion", "Begin deletion", DeletionState.ACTIVE, DeletionState.QUIESCING
    )
    fence_communities = lifecycle_action(
        "fence_community", "Fence", DeletionState.QUIESCING, DeletionState.FENCED
    )
    tombstone = lifecycle_action(
        "tombstone_community", "Tombstone", DeletionState.FENCED, DeletionState.TOMBSTONE
    )
    cancel_deletion = lifecycle_action(
        "cancel_community_deletion",
        "Cancel deletion",
        DeletionState.QUIESCING,
        DeletionState.ACTIVE,
    )
    has_begin_community_deletion_permission = operator_permission("begin_community_deletion")
    has_fence_community_permission = operator_permission("fence_community")
    has_tombstone_community_permission = operator_permission("tombstone_community")
    has_cancel_community_deletion_permission = operator_permission("cancel_community_deletion")

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.add_community")

    def get_form(self, request: HttpRequest, obj: Model | None = None, **kwargs: Any) -> Any:
        if obj is None:
            kwargs["form"] = CommunityAddForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list:
        return ["host"] if obj is None else super().get_fields(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list:
        return [] if obj is None else super().get_readonly_fields(request, obj)

    def save_model(self, request: HttpRequest, obj: Model, form: Any, change: bool) -> None:
        if change:
            raise PermissionDenied
        result = services.create_community(obj.host)
        if not result.created:
            # Taken between the form's check and now: the row is someone else's.
            messages.warning(request, f"community {result.id} had the host {result.host} already")
        # The saved row, so the admin's log entry and message name it.
        obj.pk = result.id
        obj._state.adding = False
