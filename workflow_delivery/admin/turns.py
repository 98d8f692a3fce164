"""What an agent said in each attempt of a delivery (its stored turns), as the
delivery's page shows it."""

from __future__ import annotations

from typing import Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..models import AgentTurn, WorkflowAgentDelivery
from ..protocol import DeliveryStatus
from .shared import when_full

# The timeline entries that end a claim with a verdict: a settle, a retry, a retry
# that used the last attempt. A stored turn is shown on the one of its attempt.
TURN_ENDS = frozenset({"finished", "failed", "retried", "attempts_exhausted"})
TURN_EXCERPT = 120


def ends_claim(entry: Any) -> bool:
    return entry.status_before == DeliveryStatus.CLAIMED.value and entry.kind in TURN_ENDS


def turns_of(delivery: WorkflowAgentDelivery) -> list[AgentTurn]:
    return list(
        AgentTurn.objects.using(delivery._state.db or "default")
        .filter(community_id=delivery.community_id, delivery_id=delivery.id)
        .order_by("attempts")[:50]
    )


def turn_summary(turn: AgentTurn) -> str:
    calls = len(turn.tool_calls)
    asked = len(turn.permissions)
    return (
        f"{turn.said_bytes} bytes said{' (cut)' if turn.truncated else ''}, "
        f"{calls} tool call(s), {asked} permission request(s)"
    )


def turn_links(delivery: WorkflowAgentDelivery) -> dict[int, SafeString]:
    """For the timeline: per attempt, the start of what the agent said, linked to
    the whole turn below."""
    links = {}
    for turn in turns_of(delivery):
        excerpt = turn.text[:TURN_EXCERPT] + ("…" if len(turn.text) > TURN_EXCERPT else "")
        links[turn.attempts] = format_html(
            '<a href="#wd-turn-{}" class="wd-turn-link">{}</a><br><q>{}</q>',
            turn.attempts,
            turn_summary(turn),
            excerpt,
        )
    return links


def turn_html(turn: AgentTurn) -> SafeString:
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
        when_full(turn.settled_at),
        turn.stop_reason or "—",
        turn_summary(turn),
        turn.text or "(nothing said)",
        cut,
        calls,
        asked,
    )
