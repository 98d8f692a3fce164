"""Read-mostly admin. Every table is browsable (bytes as hex); nothing is written
through a form. Operators change state only through actions, each behind its own
permission, that call ``services`` or ``fence`` and report "N done, M skipped"."""

from __future__ import annotations

import json
import operator
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import reduce
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.contrib.admin.views.main import ChangeList
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import DataError, transaction
from django.db.models import Model, Q, QuerySet
from django.db.models.functions import Lower
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from . import admin_target, communities, metrics, overview, services
from .exceptions import (
    AgentNotEnrolled,
    CommunityNotFound,
    CommunityWriteFenced,
    InvalidLifecycleTransition,
    ProtocolError,
)
from .history import delivery_history, unrecorded_attempts
from .models import (
    REASON_MAX_LENGTH,
    STATUSES,
    TERMINAL_STATUSES,
    AgentTurn,
    Community,
    CommunityAgent,
    DeletionState,
    Event,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from .protocol import CauseKind, DeliveryStatus

HEX64 = re.compile(r"[0-9a-fA-F]{64}")
SHORT_HEX = 12
# The most rows one action request acts on (and logs): a larger selection, "select
# all" included, is refused with a message rather than run inside one request.
MAX_ACTION_ROWS = 1000
# The reap action's bound: at most this many batches, flat out (no rests), per request.
REAP_ACTION_BATCHES = 10
# A key's start as the lists show it (at least SHORT_HEX hex digits, whole bytes).
HEX_PREFIX = re.compile(rf"(?:[0-9a-fA-F]{{2}}){{{SHORT_HEX // 2},31}}")


def _hex(value: bytes | memoryview) -> str:
    return bytes(value).hex()


def _short(full: str, keep: int = SHORT_HEX) -> SafeString:
    """The start of a long identifier; the whole of it on hover."""
    return format_html('<span title="{}">{}…</span>', full, full[:keep])


def _prefix_range(field: str, prefix: bytes) -> Q:
    """Keys starting with ``prefix`` as one range on the bytes (an index can serve it;
    a LIKE over bytea cannot): ``prefix <= key < the next prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return Q(**{f"{field}__gte": prefix})
    upper = stripped[:-1] + bytes([stripped[-1] + 1])
    return Q(**{f"{field}__gte": prefix, f"{field}__lt": upper})


def _as_q(lookup: tuple[str, object] | Q) -> Q:
    return lookup if isinstance(lookup, Q) else Q(**{lookup[0]: lookup[1]})


def _link(model: type[Model], object_id: object, label: object) -> SafeString:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(object_id)])
    return format_html('<a href="{}">{}</a>', url, label)


def _when(value: datetime) -> str:
    """To the second: leases are seconds long."""
    return date_format(timezone.localtime(value), "Y-m-d H:i:s T")


def _when_short(value: datetime) -> SafeString:
    """For the list: the time of day (with the month and day if not today); the full
    timestamp on hover."""
    local = timezone.localtime(value)
    today = timezone.localtime().date() == local.date()
    shown = date_format(local, "H:i:s" if today else "m-d H:i")
    return format_html('<span title="{}">{}</span>', _when(value), shown)


def shown_as(
    name: str, render: Callable[[Any], object], *, ordering: str | None = None
) -> Callable[[Model], object]:
    """A read-only column or detail field showing the field ``name`` through ``render``."""

    @admin.display(description=name.replace("_", " "), ordering=ordering)
    def show(obj: Model) -> object:
        value = getattr(obj, name)
        return None if value is None else render(value)

    show.__name__ = name
    return show


def hex_field(name: str, *, short: bool = False) -> Callable[[Model], object]:
    return shown_as(name, (lambda value: _short(_hex(value))) if short else _hex)


def time_field(name: str, *, short: bool = False) -> Callable[[Model], object]:
    return shown_as(name, _when_short if short else _when, ordering=name)


class GuardedChangeList(ChangeList):
    """A list whose lookups the database or driver refuses (a NUL in text, a malformed
    regex, a JSON key with a NUL, text for a bytes key) answers with the admin's own
    "invalid lookup" redirect instead of a 500: the page's queries run here, in a
    savepoint, and such an error becomes IncorrectLookupParameters."""

    def get_results(self, request: HttpRequest) -> None:
        try:
            with transaction.atomic(using=self.queryset.db):
                super().get_results(request)
                self.result_list = list(self.result_list)
        # TypeError: the driver refusing a value of the wrong kind for the column (text
        # for a bytea key), before the database sees it.
        except (DataError, TypeError, ValueError, ValidationError) as exc:
            raise IncorrectLookupParameters(exc) from exc


class ReadOnlyAdmin(admin.ModelAdmin):
    """View permission only: no add, change or delete through the admin, ever.
    Every entry of ``fields``/``fieldsets`` is shown read-only."""

    view_on_site = False
    hex_search_fields: tuple[str, ...] = ()
    uuid_search_fields: tuple[str, ...] = ()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return GuardedChangeList

    def response_action(
        self, request: HttpRequest, queryset: QuerySet, *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """Refuse an action request that names something other than a key (400) or
        more rows than one request acts on (a message, nothing done). Django 6.1 passes
        more arguments (``action_location``); they go on to Django unchanged."""
        selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        for value in selected:
            try:
                self.model._meta.pk.to_python(value)
            except ValidationError:
                return HttpResponseBadRequest(
                    f"{helpers.ACTION_CHECKBOX_NAME}: {value[:40]!r} is not a "
                    f"{self.model._meta.verbose_name} key"
                )
        across = request.POST.get("select_across") not in (None, "", "0")
        count = queryset.count() if across else len(selected)
        if count > MAX_ACTION_ROWS:
            self.message_user(
                request,
                f"An action acts on at most {MAX_ACTION_ROWS} rows per request; "
                f"{count} were selected. Narrow the list with its filters. Nothing was done.",
                messages.ERROR,
            )
            return None
        return super().response_action(request, queryset, *args, **kwargs)

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list:
        return flatten_fieldsets(self.fieldsets) if self.fieldsets else list(self.fields or ())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        """Each term narrows the list: a 64-hex term matches the bytes keys exactly, a
        UUID term the UUID keys exactly, anything else the text fields. Never a LIKE
        over bytea, and never over a key column."""
        for term in search_term.split():
            lookups = self._search_lookups(term)
            if not lookups:
                return queryset.none(), False
            queryset = queryset.filter(reduce(operator.or_, map(_as_q, lookups)))
        return queryset, False

    def _search_lookups(self, term: str) -> list[tuple[str, object] | Q]:
        if HEX64.fullmatch(term):
            key = bytes.fromhex(term)
            return [(field, key) for field in self.hex_search_fields]
        prefix = term.rstrip("…")
        if self.hex_search_fields and HEX_PREFIX.fullmatch(prefix):
            return [_prefix_range(field, bytes.fromhex(prefix)) for field in self.hex_search_fields]
        try:
            value = uuid.UUID(term)
        except ValueError:
            return [(f"{field}__icontains", term) for field in self.search_fields]
        return [(field, value) for field in self.uuid_search_fields]

    def _report(
        self,
        request: HttpRequest,
        action: str,
        done: int,
        considered: int,
        reasons: dict[str, int] | None = None,
    ) -> None:
        """ "N done, M skipped (why)": ``reasons`` counts the skipped rows by reason."""
        skipped = considered - done
        why = ", ".join(f"{n} {reason}" for reason, n in (reasons or {}).items() if n)
        self.message_user(
            request,
            f"{action}: {done} done, {skipped} skipped{f' ({why})' if skipped and why else ''}.",
            messages.WARNING if skipped else messages.SUCCESS,
        )


def _log_operator_change(
    request: HttpRequest, model: type[Model], objects: Iterable[Model] | None, message: str
) -> None:
    """Record an operator action in the admin log (per object when there are objects)."""
    if objects is not None:
        LogEntry.objects.log_actions(request.user.pk, list(objects), CHANGE, message)
        return
    LogEntry.objects.create(
        user_id=request.user.pk,
        content_type=ContentType.objects.get_for_model(model),
        object_repr=model._meta.verbose_name_plural,
        action_flag=CHANGE,
        change_message=message,
    )


def operator_permission(codename: str) -> Callable[[admin.ModelAdmin, HttpRequest], bool]:
    """The ``has_<codename>_permission`` method behind ``@admin.action(permissions=[codename])``."""

    def has_permission(self: admin.ModelAdmin, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    return has_permission


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
            host = communities.as_host(self.cleaned_data["host"])
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
    The add form creates a community through ``communities.create_community`` and
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
        _log_operator_change(
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
        result = communities.create_community(obj.host)
        if not result.created:
            # Taken between the form's check and now: the row is someone else's.
            messages.warning(request, f"community {result.id} had the host {result.host} already")
        # The saved row, so the admin's log entry and message name it.
        obj.pk = result.id
        obj._state.adding = False


@admin.display(description="community", ordering="community__host")
def community_link(obj: Model) -> SafeString:
    return _link(Community, obj.community_id, obj.community.host)


@admin.display(description="workflow", ordering="workflow__name")
def workflow_link(obj: Model) -> SafeString:
    return _link(Workflow, obj.workflow_id, obj.workflow.name)


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


class HexKeyChangeList(GuardedChangeList):
    """Links rows whose primary key is bytes by the hex form of the key."""

    def url_for_result(self, result: Model) -> str:
        opts = self.opts
        return reverse(
            f"admin:{opts.app_label}_{opts.model_name}_change",
            args=[_hex(result.pk)],
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


def _error(kind: str | None, message: str | None, traceback: str | None) -> str | SafeString:
    """A recorded error: its type and message, and its traceback folded away."""
    if kind is None:
        return ""
    shown = format_html('<code class="wd-error">{}: {}</code>', kind, message)
    if traceback is None:
        return shown
    return format_html(
        '{}<details class="wd-traceback"><summary>traceback</summary><pre>{}</pre></details>',
        shown,
        traceback,
    )


# The timeline entries that end a claim with a verdict: a settle, a retry, a retry
# that used the last attempt. A stored turn is shown on the one of its attempt.
_TURN_ENDS = frozenset({"finished", "failed", "retried", "attempts_exhausted"})
TURN_EXCERPT = 120


def _ends_claim(entry: Any) -> bool:
    return entry.status_before == DeliveryStatus.CLAIMED.value and entry.kind in _TURN_ENDS


def _turns_of(delivery: WorkflowAgentDelivery) -> list[AgentTurn]:
    return list(
        AgentTurn.objects.using(delivery._state.db or "default")
        .filter(community_id=delivery.community_id, delivery_id=delivery.id)
        .order_by("attempts")[:50]
    )


def _turn_summary(turn: AgentTurn) -> str:
    calls = len(turn.tool_calls)
    asked = len(turn.permissions)
    return (
        f"{turn.said_bytes} bytes said{' (cut)' if turn.truncated else ''}, "
        f"{calls} tool call(s), {asked} permission request(s)"
    )


def _turn_links(delivery: WorkflowAgentDelivery) -> dict[int, SafeString]:
    """For the timeline: per attempt, the start of what the agent said, linked to
    the whole turn below."""
    links = {}
    for turn in _turns_of(delivery):
        excerpt = turn.text[:TURN_EXCERPT] + ("…" if len(turn.text) > TURN_EXCERPT else "")
        links[turn.attempts] = format_html(
            '<a href="#wd-turn-{}" class="wd-turn-link">{}</a><br><q>{}</q>',
            turn.attempts,
            _turn_summary(turn),
            excerpt,
        )
    return links


def _turn_html(turn: AgentTurn) -> SafeString:
    cut = (
        format_html(
            '<p class="wd-agent-text-cut">cut at the bound: {} of the {} bytes said are kept</p>',
            len(turn.text.encode()),
            turn.said_bytes,
        )
        if turn.truncated
        else ""
    )
    calls = format_html_join(
        "",
        "<li>tool call <code>{}</code>: {} ({}): {}</li>",
        (
            (call.get("id"), call.get("title") or "—", call.get("kind") or "—", call.get("status"))
            for call in turn.tool_calls
        ),
    )
    asked = format_html_join(
        "",
        "<li>permission asked for {} ({}), options {}: {} ({})</li>",
        (
            (
                request.get("title"),
                request.get("kind"),
                ", ".join(request.get("options") or []) or "none",
                request.get("answer"),
                request.get("option") or "no option chosen",
            )
            for request in turn.permissions
        ),
    )
    return format_html(
        '<div class="wd-agent-turn" id="wd-turn-{}"><p>attempt {} (generation {}), '
        "settled {} at {}, stop reason {}: {}</p>"
        '<pre class="wd-agent-text">{}</pre>{}'
        '<ul class="wd-tool-calls">{}</ul><ul class="wd-permissions">{}</ul></div>',
        turn.attempts,
        turn.attempts,
        turn.generation,
        turn.outcome,
        _when(turn.settled_at),
        turn.stop_reason or "—",
        _turn_summary(turn),
        turn.text or "(nothing said)",
        cut,
        calls,
        asked,
    )


class ExpiredLeaseFilter(admin.SimpleListFilter):
    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list:
        return [("expired", "expired, awaiting the reaper")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "expired":
            # The reaper never takes a lease of a community that is not active.
            return queryset.expired_leases().in_active_communities()
        return queryset


def _left_alone(
    considered: list[uuid.UUID], done: list[uuid.UUID], reason_of: Callable[[str], str]
) -> dict[str, int]:
    """The rows an operator action left alone, counted by why (read after the action):
    a community that is not active, else ``reason_of`` their status."""
    left = WorkflowAgentDelivery.objects.filter(pk__in=set(considered) - set(done))
    reasons: dict[str, int] = defaultdict(int)
    # Read in a fixed order, so the report names the reasons in one order every time.
    rows = left.order_by("status", "id").values_list("community__deletion_state", "status")
    for state, status in rows:
        reasons["community not active" if state != DeletionState.ACTIVE else reason_of(status)] += 1
    return reasons


def _why_skipped(considered: list[uuid.UUID], done: list[uuid.UUID]) -> dict[str, int]:
    """The rows a release or a mark-failed left alone, counted by why."""

    def reason_of(status: str) -> str:
        if status in TERMINAL_STATUSES:
            return "already terminal"
        if status == DeliveryStatus.PENDING:
            return "not claimed"
        return "changed meanwhile"

    return _left_alone(considered, done, reason_of)


def _why_not_retried(considered: list[uuid.UUID], done: list[uuid.UUID]) -> dict[str, int]:
    """The rows a retry left alone, counted by why."""

    def reason_of(status: str) -> str:
        if status == DeliveryStatus.FINISHED:
            return "finished, never reopened"
        return f"{status}, not failed"

    return _left_alone(considered, done, reason_of)


@admin.register(WorkflowAgentDelivery)
class DeliveryAdmin(ReadOnlyAdmin):
    # What an operator reads first, in one short line per row at 1,400 px; the
    # workflow, run, cause identity and settle times are on the delivery's page.
    list_display = [
        "delivery",
        "status",
        community_link,
        "step_id",
        "target_link",
        "attempts",
        "generation",
        "lease_expiry_short",
        time_field("created_at", short=True),
    ]
    list_filter = ["status", "cause_kind", "community", ExpiredLeaseFilter]
    list_select_related = ["community", "workflow"]
    date_hierarchy = "created_at"
    show_full_result_count = False
    change_list_template = "admin/workflow_delivery/workflowagentdelivery/change_list.html"
    search_fields = ["step_id"]
    uuid_search_fields = ("id", "run_id")
    hex_search_fields = ("target_pubkey", "message_event_id")
    search_help_text = (
        "A delivery or run id, a target or message event id (64 hex, or its first 12 hex "
        "as the list shows it), or part of a step id."
    )
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "status",
                    community_link,
                    "community_notice",
                    workflow_link,
                    "run_link",
                    "step_id",
                ]
            },
        ),
        (
            None,
            {
                "fields": [
                    hex_field("target_pubkey"),
                    "target_state_link",
                    hex_field("definition_event_id"),
                ]
            },
        ),
        (
            "Message",
            {"fields": ["message_event_link", time_field("message_event_created_at"), "replies"]},
        ),
        ("Agent turns", {"fields": ["agent_turns"]}),
        (
            "Cause",
            {
                "fields": [
                    "cause_kind",
                    hex_field("cause_event_id"),
                    time_field("cause_scheduled_for"),
                    "cause_webhook_invocation_id",
                ]
            },
        ),
        (
            "Lease",
            {
                "fields": [
                    "attempts",
                    "lease_generation",
                    "lease_expiry",
                    time_field("claimed_at"),
                    time_field("finished_at"),
                    "retry_after",
                ]
            },
        ),
        ("Last error", {"fields": ["last_error"]}),
        (None, {"fields": [time_field("created_at")]}),
        ("Timeline", {"fields": ["timeline"]}),
    ]
    actions = ["reap_expired_leases", "release_leases", "mark_failed", "retry_failed"]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The workflow's definition can be large and no page of deliveries shows it.
        return super().get_queryset(request).defer("workflow__definition")

    @admin.display(description="delivery", ordering="id")
    def delivery(self, obj: WorkflowAgentDelivery) -> SafeString:
        return _short(str(obj.id), keep=8)

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        return _link(WorkflowRun, obj.run_id, _short(str(obj.run_id), keep=8))

    @admin.display(description="target pubkey", ordering="target_pubkey")
    def target_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        """The target's start, linked to its "why not delivered?" page."""
        url = admin_target.target_url(obj.community_id, obj.target_pubkey)
        return format_html('<a href="{}">{}</a>', url, _short(_hex(obj.target_pubkey)))

    @admin.display(description="why not delivered?")
    def target_state_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        url = admin_target.target_url(obj.community_id, obj.target_pubkey)
        return format_html(
            '<a href="{}" class="wd-target-link">{}</a>',
            url,
            "this target in this community: pending, leases, last claim and settle, verdict",
        )

    @admin.display(description="message event")
    def message_event_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        key = _hex(obj.message_event_id)
        return _link(Event, key, key)

    @admin.display(description="cause", ordering="cause_kind")
    def cause(self, obj: WorkflowAgentDelivery) -> SafeString:
        if obj.cause_kind == CauseKind.EVENT:
            identity = _short(_hex(obj.cause_event_id))
        elif obj.cause_kind == CauseKind.SCHEDULE:
            identity = _when(obj.cause_scheduled_for)
        else:
            identity = _short(str(obj.cause_webhook_invocation_id), keep=8)
        return format_html("{} {}", obj.cause_kind, identity)

    @admin.display(description="community state")
    def community_notice(self, obj: WorkflowAgentDelivery) -> str | SafeString:
        state = obj.community.deletion_state
        if state == DeletionState.ACTIVE:
            return state
        if obj.status == DeliveryStatus.CLAIMED:
            effect = "the reaper skips this lease"
        else:
            effect = "nothing writes to this delivery"
        return format_html(
            '<strong class="wd-community-inactive">community {}: {}</strong>', state, effect
        )

    @admin.display(description="timeline")
    def timeline(self, obj: WorkflowAgentDelivery) -> SafeString:
        # The stored entries and the ones the row itself implies, merged in order.
        entries = delivery_history(obj)
        said = _turn_links(obj)
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td><td>{}</td></tr>",
            (
                (
                    _when(entry.at),
                    entry.kind,
                    f"{entry.status_before or '—'} → {entry.status_after}",
                    entry.generation,
                    entry.attempts,
                    entry.actor,
                    f"reason: {entry.reason}"
                    if entry.reason
                    else _error(entry.error_type, entry.error_message, entry.error_traceback),
                    said.pop(entry.attempts, "") if _ends_claim(entry) else "",
                )
                for entry in entries
            ),
        )
        missing = unrecorded_attempts(entries, obj)
        note = (
            format_html(
                '<p class="wd-timeline-gap">{} earlier attempt(s) not recorded '
                "(the timeline was off when they ended).</p>",
                missing,
            )
            if missing
            else ""
        )
        return format_html(
            '<table class="wd-timeline"><thead><tr><th>at</th><th>transition</th>'
            "<th>status</th><th>generation</th><th>attempts</th><th>actor</th><th>error</th>"
            "<th>agent said</th></tr></thead><tbody>{}</tbody></table>{}",
            rows,
            note,
        )

    @admin.display(description="agent turns")
    def agent_turns(self, obj: WorkflowAgentDelivery) -> str | SafeString:
        # What an ACP agent said in each attempt, stored with its settle. Agent text
        # is untrusted: every part of it goes through format_html's escaping.
        turns = _turns_of(obj)
        if not turns:
            return "—"
        return format_html_join("", "{}", ((_turn_html(turn),) for turn in turns))

    @admin.display(description="replies")
    def replies(self, obj: WorkflowAgentDelivery) -> str | SafeString:
        # Messages tagged as replies to this delivery's message (the ACP runtime's
        # reply tool writes them), oldest first.
        marker = ["e", bytes(obj.message_event_id).hex(), "", "reply"]
        found = (
            Event.objects.filter(community_id=obj.community_id, tags__contains=[marker])
            .order_by("created_at")
            .values_list("pubkey", "content")[:50]
        )
        if not found:
            return "—"
        return format_html(
            '<ul class="wd-replies">{}</ul>',
            format_html_join(
                "",
                "<li><code>{}</code>: {}</li>",
                ((bytes(pubkey).hex()[:12], content[:500]) for pubkey, content in found),
            ),
        )

    @admin.display(description="last error")
    def last_error(self, obj: WorkflowAgentDelivery) -> str | SafeString:
        if obj.last_error_type is None:
            return "—"
        return format_html(
            '{} <span class="wd-error-at">({})</span>',
            _error(obj.last_error_type, obj.last_error_message, None),
            _when(obj.last_error_at),
        )

    @admin.display(description="retry not before")
    def retry_after(self, obj: WorkflowAgentDelivery) -> str | None:
        if obj.available_at is None:
            return None
        shown = _when(obj.available_at)
        # The application clock flags it on screen; claims decide by the database clock.
        if obj.available_at > timezone.now():
            return format_html('<strong class="wd-backing-off">{} (backing off)</strong>', shown)
        return shown

    @admin.display(description="gen", ordering="lease_generation")
    def generation(self, obj: WorkflowAgentDelivery) -> int:
        return obj.lease_generation

    @admin.display(description="lease until", ordering="lease_until")
    def lease_expiry_short(self, obj: WorkflowAgentDelivery) -> SafeString | None:
        if obj.lease_until is None:
            return None
        shown = _when_short(obj.lease_until)
        if obj.lease_until < timezone.now():
            return format_html('<strong class="wd-lease-expired">{} (expired)</strong>', shown)
        return shown

    @admin.display(description="lease until", ordering="lease_until")
    def lease_expiry(self, obj: WorkflowAgentDelivery) -> str | None:
        if obj.lease_until is None:
            return None
        shown = _when(obj.lease_until)
        # The application clock is good enough to flag a row on screen; the reaper and
        # the holder decide by the database clock.
        if obj.lease_until < timezone.now():
            return format_html('<strong class="wd-lease-expired">{} (expired)</strong>', shown)
        return shown

    @admin.action(
        permissions=["reap_deliveries"],
        description="Reap every expired lease now (all communities, not only the selected)",
    )
    def reap_expired_leases(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._reap_now(request)

    def _reap_now(self, request: HttpRequest) -> None:
        # Bounded inside the HTTP request: a few batches flat out, never the rests of a
        # full sweep; the reap_deliveries command or loop does the rest.
        batches = []
        reaped = services.reap_deliveries(
            yield_ratio=0,
            on_batch=lambda count, seconds: batches.append(count),
            should_stop=lambda: len(batches) >= REAP_ACTION_BATCHES,
        )
        skipped = WorkflowAgentDelivery.objects.expired_leases().in_fenced_communities().count()
        _log_operator_change(
            request,
            WorkflowAgentDelivery,
            None,
            f"Reaped {reaped.total} expired leases ({reaped.exhausted} settled failed: every "
            f"attempt used); {skipped} left in communities not active",
        )
        self._report(
            request,
            "Reap expired leases",
            reaped.total,
            reaped.total + skipped,
            {"in communities not active": skipped},
        )
        if reaped.exhausted:
            self.message_user(
                request,
                f"{reaped.exhausted} of them had used every attempt: settled failed.",
                messages.WARNING,
            )

    def reap_view(self, request: HttpRequest) -> HttpResponse:
        """ "Reap expired leases now" from the list page, without selecting a row."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_reap_deliveries_permission(request):
            raise PermissionDenied
        self._reap_now(request)
        return HttpResponseRedirect(
            reverse("admin:workflow_delivery_workflowagentdelivery_changelist")
        )

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        """Per community: fence state, counts by status, oldest pending age, expired
        leases; and settles per minute over the last hour, drawn as SVG. It shows every
        community's deliveries, so it asks what the delivery list asks."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        figures = sorted(metrics.community_figures().values(), key=lambda f: f.host)
        per_minute = overview.settles_per_minute()
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Delivery overview",
            "communities": figures,
            "statuses": STATUSES,
            "plot": overview.settles_plot(per_minute),
            "settled_last_hour": sum(per_minute),
            "can_reap": self.has_reap_deliveries_permission(request),
        }
        return TemplateResponse(request, "admin/workflow_delivery/overview.html", context)

    def target_view(self, request: HttpRequest, community_id: str, target: str) -> HttpResponse:
        return admin_target.target_view(self, request, community_id, target)

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("overview/", view(self.overview_view), name="workflow_delivery_overview"),
            path("reap/", view(self.reap_view), name="workflow_delivery_reap"),
            path(
                "target/<str:community_id>/<str:target>/",
                view(self.target_view),
                name=admin_target.URL_NAME,
            ),
            *super().get_urls(),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        extra = {"can_reap": self.has_reap_deliveries_permission(request)}
        return super().changelist_view(request, {**(extra_context or {}), **extra})

    @admin.action(permissions=["release_delivery"], description="Release the lease")
    def release_leases(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._operate(
            request,
            queryset,
            services.release_deliveries,
            "Release lease",
            "Released by an operator: back to pending, lease generation bumped",
        )

    @admin.action(permissions=["fail_delivery"], description="Mark failed (operator terminal)")
    def mark_failed(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._operate(
            request,
            queryset,
            services.fail_deliveries,
            "Mark failed",
            "Marked failed by an operator (operator terminal)",
        )

    @admin.action(
        permissions=["retry_delivery"],
        description="Retry failed deliveries (back to pending, attempts renewed)",
    )
    def retry_failed(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        """First a page asking why (the reason goes on each timeline), then the retry."""
        reason = request.POST.get("reason", "")
        if "apply" in request.POST and reason.strip():
            try:
                self._operate(
                    request,
                    queryset,
                    services.retry_failed_deliveries,
                    "Retry",
                    f"Retried by an operator: back to pending, attempts renewed ({reason})",
                    _why_not_retried,
                    reason=reason,
                )
            except ProtocolError as exc:
                self.message_user(request, f"Retry: {exc}. Nothing was done.", messages.ERROR)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Retry failed deliveries",
            "opts": self.opts,
            "deliveries": queryset.select_related("community").order_by("community__host", "id"),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "reason": reason,
            "reason_missing": "apply" in request.POST,
            "reason_max_length": REASON_MAX_LENGTH,
        }
        return TemplateResponse(
            request, "admin/workflow_delivery/workflowagentdelivery/retry.html", context
        )

    def _operate(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        service: Callable[..., list[uuid.UUID]],
        action: str,
        log_message: str,
        why: Callable[[list[uuid.UUID], list[uuid.UUID]], dict[str, int]] = _why_skipped,
        **options: str,
    ) -> None:
        """Call ``service`` once per community of the selection; it changes only the
        eligible rows of active communities and returns their ids."""
        by_community: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        for community_id, delivery_id in queryset.values_list("community_id", "id"):
            by_community[community_id].append(delivery_id)
        operator = request.user.get_username()
        done = [
            i
            for community, ids in by_community.items()
            for i in service(community, ids, operator=operator, **options)
        ]
        if done:
            changed = WorkflowAgentDelivery.objects.filter(pk__in=done)
            _log_operator_change(request, WorkflowAgentDelivery, changed, log_message)
        considered = [i for ids in by_community.values() for i in ids]
        self._report(request, action, len(done), len(considered), why(considered, done))

    has_reap_deliveries_permission = operator_permission("reap_deliveries")

    has_release_delivery_permission = operator_permission("release_delivery")
    has_fail_delivery_permission = operator_permission("fail_delivery")
    has_retry_delivery_permission = operator_permission("retry_delivery")


@admin.register(CommunityAgent)
class CommunityAgentAdmin(ReadOnlyAdmin):
    """A community's agent roster. Keys are enrolled by ``services.enroll_agents`` (or
    ``manage.py enroll_agent``); here an operator revokes and reinstates them, each
    action behind its own permission. Revoking releases the key's leases."""

    list_display = [
        hex_field("pubkey", short=True),
        "label",
        community_link,
        "enabled",
        time_field("added_at", short=True),
        time_field("revoked_at", short=True),
    ]
    list_filter = ["enabled", "community"]
    list_select_related = ["community"]
    search_fields = ["label"]
    hex_search_fields = ("pubkey",)
    search_help_text = (
        "An agent key (64 hex, or its first 12 hex as the list shows it), or a label."
    )
    fields = [
        hex_field("pubkey"),
        "label",
        community_link,
        "enabled",
        time_field("added_at"),
        time_field("revoked_at"),
    ]
    actions = ["revoke_agents", "reinstate_agents"]

    @admin.action(permissions=["revoke_agent"], description="Revoke (and release its leases)")
    def revoke_agents(self, request: HttpRequest, queryset: QuerySet) -> None:
        operator = request.user.get_username()
        done, released = [], 0
        considered = list(queryset.filter(enabled=True))
        for agent in considered:
            try:
                revocation = services.revoke_agent(
                    agent.community_id, bytes(agent.pubkey), operator=operator
                )
            except (AgentNotEnrolled, CommunityWriteFenced):
                continue  # removed by a purge, or its community is being deleted
            done.append(agent)
            released += len(revocation.released)
        if done:
            _log_operator_change(
                request,
                CommunityAgent,
                done,
                f"Revoked by an operator; {released} leases released",
            )
        skipped = {"already revoked": queryset.count() - len(considered)}
        skipped["community not active"] = len(considered) - len(done)
        self._report(request, "Revoke", len(done), queryset.count(), skipped)

    @admin.action(permissions=["reinstate_agent"], description="Reinstate")
    def reinstate_agents(self, request: HttpRequest, queryset: QuerySet) -> None:
        done = []
        considered = list(queryset.filter(enabled=False))
        for agent in considered:
            try:
                services.reinstate_agent(agent.community_id, bytes(agent.pubkey))
            except (AgentNotEnrolled, CommunityWriteFenced):
                continue
            done.append(agent)
        if done:
            _log_operator_change(request, CommunityAgent, done, "Reinstated by an operator")
        skipped = {"enabled": queryset.count() - len(considered)}
        skipped["community not active"] = len(considered) - len(done)
        self._report(request, "Reinstate", len(done), queryset.count(), skipped)

    has_revoke_agent_permission = operator_permission("revoke_agent")
    has_reinstate_agent_permission = operator_permission("reinstate_agent")
