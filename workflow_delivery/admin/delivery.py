"""The deliveries' admin: the list an operator reads first, a delivery's page with its
timeline, turns and replies, the overview, and the actions that call ``services``
(release, fail, retry, reap), each behind its own permission."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import metrics, overview, services
from ..exceptions import ProtocolError
from ..models import (
    REASON_MAX_LENGTH,
    STATUSES,
    TERMINAL_STATUSES,
    DeletionState,
    Event,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from ..protocol import CauseKind, DeliveryStatus
from .shared import (
    ExpiredLeaseFilter,
    ReadOnlyAdmin,
    community_link,
    error_html,
    hex_field,
    hex_text,
    link_to,
    log_operator_change,
    operator_permission,
    shortened,
    time_field,
    when_full,
    when_short,
    workflow_link,
)
from .target import URL_NAME, target_url, target_view
from .timeline import timeline_table
from .turns import turn_html, turns_of

# The reap action's bound: at most this many batches, flat out (no rests), per request.
REAP_ACTION_BATCHES = 10


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
        return shortened(str(obj.id), keep=8)

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        return link_to(WorkflowRun, obj.run_id, shortened(str(obj.run_id), keep=8))

    @admin.display(description="target pubkey", ordering="target_pubkey")
    def target_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        """The target's start, linked to its "why not delivered?" page."""
        url = target_url(obj.community_id, obj.target_pubkey)
        return format_html('<a href="{}">{}</a>', url, shortened(hex_text(obj.target_pubkey)))

    @admin.display(description="why not delivered?")
    def target_state_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        url = target_url(obj.community_id, obj.target_pubkey)
        return format_html(
            '<a href="{}" class="wd-target-link">{}</a>',
            url,
            "this target in this community: pending, leases, last claim and settle, verdict",
        )

    @admin.display(description="message event")
    def message_event_link(self, obj: WorkflowAgentDelivery) -> SafeString:
        key = hex_text(obj.message_event_id)
        return link_to(Event, key, key)

    @admin.display(description="cause", ordering="cause_kind")
    def cause(self, obj: WorkflowAgentDelivery) -> SafeString:
        if obj.cause_kind == CauseKind.EVENT:
            identity = shortened(hex_text(obj.cause_event_id))
        elif obj.cause_kind == CauseKind.SCHEDULE:
            identity = when_full(obj.cause_scheduled_for)
        else:
            identity = shortened(str(obj.cause_webhook_invocation_id), keep=8)
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
        return timeline_table(obj)

    @admin.display(description="agent turns")
    def agent_turns(self, obj: WorkflowAgentDelivery) -> str | SafeString:
        # What an ACP agent said in each attempt, stored with its settle. Agent text
        # is untrusted: every part of it goes through format_html's escaping.
        turns = turns_of(obj)
        if not turns:
            return "—"
        return format_html_join("", "{}", ((turn_html(turn),) for turn in turns))

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
            error_html(obj.last_error_type, obj.last_error_message, None),
            when_full(obj.last_error_at),
        )

    @admin.display(description="retry not before")
    def retry_after(self, obj: WorkflowAgentDelivery) -> str | None:
        if obj.available_at is None:
            return None
        shown = when_full(obj.available_at)
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
        shown = when_short(obj.lease_until)
        if obj.lease_until < timezone.now():
            return format_html('<strong class="wd-lease-expired">{} (expired)</strong>', shown)
        return shown

    @admin.display(description="lease until", ordering="lease_until")
    def lease_expiry(self, obj: WorkflowAgentDelivery) -> str | None:
        if obj.lease_until is None:
            return None
        shown = when_full(obj.lease_until)
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
        log_operator_change(
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
        return target_view(self, request, community_id, target)

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("overview/", view(self.overview_view), name="workflow_delivery_overview"),
            path("reap/", view(self.reap_view), name="workflow_delivery_reap"),
            path(
                "target/<str:community_id>/<str:target>/",
                view(self.target_view),
                name=URL_NAME,
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
            log_operator_change(request, WorkflowAgentDelivery, changed, log_message)
        considered = [i for ids in by_community.values() for i in ids]
        self._report(request, action, len(done), len(considered), why(considered, done))

    has_reap_deliveries_permission = operator_permission("reap_deliveries")

    has_release_delivery_permission = operator_permission("release_delivery")
    has_fail_delivery_permission = operator_permission("fail_delivery")
    has_retry_delivery_permission = operator_permission("retry_delivery")
