"""The admin's answer to "why is this not delivered?" for one (community, target).

One statement (``store.statements.TARGET_STATE``) reads what the inbox holds for the target: its
pending rows (how many wait for a retry backoff, the next to become claimable, the
oldest), its claimed rows (expired leases the reaper has not taken yet), its settles
among the community's most recent ones, its last error, its last claim and whether a
consumer of it is registered idle, and if so whether the session the registration
names (``pid`` and ``backend_start``) is still in ``pg_stat_activity``: a consumer
that died without taking its registration back left it, and nobody waits for its
wake-up; and the community's fence state. ``verdicts`` turns
that into plain sentences, the most blocking first. The page asks what the delivery
list asks (its view permission); it changes nothing.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.dateformat import format as date_format

from ..conf import app_settings
from ..models import DeletionState
from ..store import run, statements

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

# How many of a community's most recent settles are searched for the target's: terminal
# rows have no index by target, so the page reads a bounded window of them.
SETTLE_WINDOW = 1000
TARGET_HEX = re.compile(r"[0-9a-fA-F]{64}")
# How much of a malformed URL part a 400 repeats.
ECHO = 80

URL_NAME = "workflow_delivery_target"

# What pg_stat_activity says of the session an idle registration names
# (``store.statements.TARGET_STATE``): still the same backend; no such backend any
# more; or hidden from the reading role (another role's session shows no start time).
IDLE_LIVE = "live"
IDLE_GONE = "gone"
IDLE_UNSEEN = "unseen"


@dataclass(frozen=True)
class TargetState:
    """What the inbox holds for one (community, target), read at ``now`` (database clock)."""

    community_id: uuid.UUID
    target_pubkey: bytes
    now: datetime
    host: str
    deletion_state: str
    pending: int
    backing_off: int
    next_available_at: datetime | None
    oldest_pending_at: datetime | None
    claimed: int
    expired_leases: int
    first_expired_at: datetime | None
    live_lease_until: datetime | None
    last_claimed_at: datetime | None
    window: int
    window_settles: int
    window_since: datetime | None
    settled: int
    last_settled_at: datetime | None
    attempts_exhausted: int
    last_error_type: str | None
    last_error_message: str | None
    last_error_at: datetime | None
    idle_since: datetime | None
    # The registering session: IDLE_LIVE, IDLE_GONE, IDLE_UNSEEN, or None (no registration).
    idle_session: str | None = None

    @property
    def fenced(self) -> bool:
        return self.deletion_state != DeletionState.ACTIVE

    @property
    def claimable(self) -> int:
        """Pending rows a claim may take now (none while the community is fenced)."""
        return 0 if self.fenced else self.pending - self.backing_off

    @property
    def live_leases(self) -> int:
        return self.claimed - self.expired_leases

    @property
    def oldest_pending_age(self) -> timedelta | None:
        return None if self.oldest_pending_at is None else self.now - self.oldest_pending_at


def read_target_state(
    community_id: uuid.UUID,
    target_pubkey: bytes,
    *,
    window: int = SETTLE_WINDOW,
    using: str = DEFAULT_DB_ALIAS,
) -> TargetState | None:
    """The target's state in one query, or None if the community does not exist."""
    params = {
        "community": community_id,
        "target": target_pubkey,
        "window": window,
        "cap": app_settings.MAX_ATTEMPTS,
    }
    (row,) = run.fetch(using, statements.TARGET_STATE, params, savepoint=False)
    (now, host, state, *figures) = row
    if host is None:
        return None
    (
        pending,
        backing_off,
        next_available_at,
        oldest_pending_at,
        claimed,
        expired,
        first_expired_at,
        live_until,
        last_claimed_at,
        window_settles,
        window_since,
        settled,
        last_settled_at,
        exhausted,
        error_type,
        error_message,
        error_at,
        idle_since,
        idle_session,
    ) = figures
    return TargetState(
        community_id=community_id,
        target_pubkey=bytes(target_pubkey),
        now=now,
        host=host,
        deletion_state=state,
        pending=pending,
        backing_off=backing_off,
        next_available_at=next_available_at,
        oldest_pending_at=oldest_pending_at,
        claimed=claimed,
        expired_leases=expired,
        first_expired_at=first_expired_at,
        live_lease_until=live_until,
        last_claimed_at=last_claimed_at,
        window=window,
        window_settles=window_settles,
        window_since=window_since,
        settled=settled,
        last_settled_at=last_settled_at,
        attempts_exhausted=exhausted,
        last_error_type=error_type,
        last_error_message=error_message,
        last_error_at=error_at,
        idle_since=idle_since,
        idle_session=idle_session,
    )


def when(value: datetime) -> str:
    return date_format(timezone.localtime(value), "Y-m-d H:i:s T")


def age(delta: timedelta) -> str:
    """A duration as a person reads it: "42 s", "3 min 5 s", "2 h 10 min", "4 d 3 h"."""
    seconds = max(int(delta.total_seconds()), 0)
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    if days:
        return f"{days} d {h} h"
    if hours:
        return f"{hours} h {m} min"
    if minutes:
        return f"{minutes} min {s} s"
    return f"{s} s"


def _deliveries(n: int) -> str:
    return f"{n} delivery" if n == 1 else f"{n} deliveries"


@dataclass(frozen=True)
class Verdict:
    kind: str
    text: str


def verdicts(state: TargetState) -> list[Verdict]:
    """Why the target's deliveries are (not) delivered, the most blocking reason first."""
    found: list[Verdict] = []

    def say(kind: str, text: str) -> None:
        found.append(Verdict(kind, text))

    if state.fenced:
        say(
            "fenced",
            f"community is {state.deletion_state}: nothing is claimable (the write fence "
            "refuses every claim and settle, and the reaper skips the community)",
        )
    if state.expired_leases:
        more = f" ({state.expired_leases} expired leases)" if state.expired_leases > 1 else ""
        if state.fenced:
            say(
                "expired",
                f"lease expired at {when(state.first_expired_at)}{more}; the reaper does not "
                "take it while the community is not active",
            )
        else:
            say(
                "expired",
                f"lease expired at {when(state.first_expired_at)}, reaper has not run{more}",
            )
    gone = (
        f"the consumer that registered idle at {when(state.idle_since)} is gone (its "
        "session ended without unregistering): no consumer is waiting"
        if state.idle_session == IDLE_GONE
        else None
    )
    if state.claimable and not state.live_leases:
        waiting = (
            f"{_deliveries(state.claimable)} claimable, the oldest pending for "
            f"{age(state.oldest_pending_age)}"
        )
        if gone is not None:
            say("gone", f"{gone}, yet {waiting}")
            gone = None
        elif state.idle_since is not None:
            say(
                "idle",
                f"an agent registered idle at {when(state.idle_since)}, yet {waiting}: a "
                "backoff that ends sends no wake-up, so it claims them at its next poll",
            )
        elif state.last_claimed_at is not None:
            say(
                "unclaimed",
                f"no agent has claimed for this target since {when(state.last_claimed_at)}: "
                f"{waiting}",
            )
        else:
            say(
                "unclaimed", f"no agent has claimed for this target (no claim on record): {waiting}"
            )
    if gone is not None and state.pending and not state.live_leases:
        # Rows backing off (or not claimable while fenced): none is claimed when it could be.
        say("gone", f"{gone}: these deliveries wait until a consumer starts")
        gone = None
    if state.backing_off:
        verb = "is waiting for its" if state.backing_off == 1 else "are waiting for their"
        first = "" if state.backing_off == 1 else " (the first of them)"
        say(
            "backoff",
            f"{_deliveries(state.backing_off)} {verb} retry backoff until "
            f"{when(state.next_available_at)}{first}",
        )
    if state.attempts_exhausted:
        say(
            "exhausted",
            f"{_deliveries(state.attempts_exhausted)} failed with every attempt used "
            f"(WORKFLOW_DELIVERY_MAX_ATTEMPTS), among the community's last "
            f"{state.window_settles} settles",
        )
    if state.live_leases and not state.fenced:
        more = f"; {_deliveries(state.claimable)} more claimable" if state.claimable else ""
        say(
            "held",
            f"an agent is working: {state.live_leases} live lease"
            f"{'s' if state.live_leases > 1 else ''}, until {when(state.live_lease_until)}{more}",
        )
    if not state.pending and not state.claimed:
        last = (
            f"; last settle at {when(state.last_settled_at)}"
            if state.last_settled_at is not None
            else ""
        )
        say("nothing", f"nothing is waiting for this target: no pending or claimed delivery{last}")
    if gone is not None:
        after = "" if state.live_leases else ": a new delivery waits until a consumer starts"
        say("gone", f"{gone}{after}")
    return found


def agent_activity(state: TargetState) -> str:
    """Whether any agent is claiming for the target, from what the database holds."""
    signs = []
    if state.live_leases:
        signs.append(f"yes: a live lease until {when(state.live_lease_until)}")
    if state.idle_session == IDLE_GONE:
        signs.append(
            f"no: the consumer registered idle at {when(state.idle_since)} is gone (its "
            "session ended without unregistering)"
        )
    elif state.idle_session == IDLE_UNSEEN:
        signs.append(
            f"a consumer registered idle at {when(state.idle_since)}; whether its session "
            "is still alive is hidden from this database role (another role's session)"
        )
    elif state.idle_since is not None:
        signs.append(
            f"a consumer is registered idle (waiting for a wake-up) since {when(state.idle_since)}"
        )
    if state.last_claimed_at is not None:
        since = age(state.now - state.last_claimed_at)
        signs.append(f"last claim at {when(state.last_claimed_at)} ({since} ago)")
    return (
        "; ".join(signs)
        or "no sign of one: no live lease, no idle registration, no claim on record"
    )


def target_url(community_id: uuid.UUID, target_pubkey: bytes) -> str:
    return reverse(f"admin:{URL_NAME}", args=[str(community_id), bytes(target_pubkey).hex()])


def _bad(what: str, value: str, expected: str) -> HttpResponseBadRequest:
    # Plain text: the value is the caller's and is never rendered as HTML.
    return HttpResponseBadRequest(
        f"{what} {value[:ECHO]!r} is not {expected}", content_type="text/plain; charset=utf-8"
    )


def target_view(
    model_admin: ModelAdmin, request: HttpRequest, community_id: str, target: str
) -> HttpResponse:
    """The page. A malformed community id or target is a 400 naming the part; a
    community that does not exist is a 404."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    try:
        community = uuid.UUID(community_id)
    except ValueError:
        return _bad("community id", community_id, "a UUID")
    if not TARGET_HEX.fullmatch(target):
        return _bad("target", target, "a public key (64 hex digits)")
    state = read_target_state(community, bytes.fromhex(target))
    if state is None:
        raise Http404(f"community {community} does not exist")
    opts = model_admin.opts
    found = verdicts(state)
    target_hex = target.lower()
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": opts,
        "title": "Why not delivered?",
        "state": state,
        "target_hex": target_hex,
        "verdict": found[0] if found else None,
        "verdicts": found,
        "agent": agent_activity(state),
        "times": {
            name: None if value is None else when(value)
            for name, value in (
                ("now", state.now),
                ("next_available", state.next_available_at),
                ("oldest_pending", state.oldest_pending_at),
                ("first_expired", state.first_expired_at),
                ("live_until", state.live_lease_until),
                ("last_claimed", state.last_claimed_at),
                ("window_since", state.window_since),
                ("last_settled", state.last_settled_at),
                ("last_error", state.last_error_at),
            )
        },
        "oldest_pending_age": None
        if state.oldest_pending_age is None
        else age(state.oldest_pending_age),
        "community_url": reverse(f"admin:{opts.app_label}_community_change", args=[str(community)]),
        "deliveries_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        + f"?community__id__exact={community}&q={target_hex}",
    }
    return TemplateResponse(
        request, f"admin/{opts.app_label}/{opts.model_name}/target.html", context
    )
