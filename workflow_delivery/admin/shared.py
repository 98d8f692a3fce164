"""What the model admins share: the read-only base admin with its guarded lists and
search by hex prefix, the "N done, M skipped" report, the admin log of operator
actions, action permissions, the list filter of expired leases, and the helpers that
show keys, times, links and recorded errors."""

from __future__ import annotations

import operator
import re
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import reduce
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.contrib.admin.views.main import ChangeList
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ValidationError
from django.db import DataError, transaction
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Community, Workflow

HEX64 = re.compile(r"[0-9a-fA-F]{64}")
SHORT_HEX = 12
# The most rows one action request acts on (and logs): a larger selection, "select
# all" included, is refused with a message rather than run inside one request.
MAX_ACTION_ROWS = 1000
# A key's start as the lists show it (at least SHORT_HEX hex digits, whole bytes).
HEX_PREFIX = re.compile(rf"(?:[0-9a-fA-F]{{2}}){{{SHORT_HEX // 2},31}}")


def hex_text(value: bytes | memoryview) -> str:
    return bytes(value).hex()


def shortened(full: str, keep: int = SHORT_HEX) -> SafeString:
    """The start of a long identifier; the whole of it on hover."""
    return format_html('<span title="{}">{}…</span>', full, full[:keep])


def prefix_range(field: str, prefix: bytes) -> Q:
    """Keys starting with ``prefix`` as one range on the bytes (an index can serve it;
    a LIKE over bytea cannot): ``prefix <= key < the next prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return Q(**{f"{field}__gte": prefix})
    upper = stripped[:-1] + bytes([stripped[-1] + 1])
    return Q(**{f"{field}__gte": prefix, f"{field}__lt": upper})


def as_q(lookup: tuple[str, object] | Q) -> Q:
    return lookup if isinstance(lookup, Q) else Q(**{lookup[0]: lookup[1]})


def link_to(model: type[Model], object_id: object, label: object) -> SafeString:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(object_id)])
    return format_html('<a href="{}">{}</a>', url, label)


def when_full(value: datetime) -> str:
    """To the second: leases are seconds long."""
    return date_format(timezone.localtime(value), "Y-m-d H:i:s T")


def when_short(value: datetime) -> SafeString:
    """For the list: the time of day (with the month and day if not today); the full
    timestamp on hover."""
    local = timezone.localtime(value)
    today = timezone.localtime().date() == local.date()
    shown = date_format(local, "H:i:s" if today else "m-d H:i")
    return format_html('<span title="{}">{}</span>', when_full(value), shown)


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
    return shown_as(name, (lambda value: shortened(hex_text(value))) if short else hex_text)


def time_field(name: str, *, short: bool = False) -> Callable[[Model], object]:
    return shown_as(name, when_short if short else when_full, ordering=name)


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
            queryset = queryset.filter(reduce(operator.or_, map(as_q, lookups)))
        return queryset, False

    def _search_lookups(self, term: str) -> list[tuple[str, object] | Q]:
        if HEX64.fullmatch(term):
            key = bytes.fromhex(term)
            return [(field, key) for field in self.hex_search_fields]
        prefix = term.rstrip("…")
        if self.hex_search_fields and HEX_PREFIX.fullmatch(prefix):
            return [prefix_range(field, bytes.fromhex(prefix)) for field in self.hex_search_fields]
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


def log_operator_change(
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


@admin.display(description="community", ordering="community__host")
def community_link(obj: Model) -> SafeString:
    return link_to(Community, obj.community_id, obj.community.host)


@admin.display(description="workflow", ordering="workflow__name")
def workflow_link(obj: Model) -> SafeString:
    return link_to(Workflow, obj.workflow_id, obj.workflow.name)


def error_html(kind: str | None, message: str | None, traceback: str | None) -> str | SafeString:
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
