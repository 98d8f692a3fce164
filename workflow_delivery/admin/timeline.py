"""A delivery's timeline as its admin page shows it: the stored entries and the ones
the row itself implies, merged in order, each ended claim with what the agent said."""

from __future__ import annotations

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..history import delivery_history, unrecorded_attempts
from ..models import WorkflowAgentDelivery
from .shared import error_html, when_full
from .turns import ends_claim, turn_links


def timeline_table(obj: WorkflowAgentDelivery) -> SafeString:
    # The stored entries and the ones the row itself implies, merged in order.
    entries = delivery_history(obj)
    said = turn_links(obj)
    rows = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td></tr>",
        (
            (
                when_full(entry.at),
                entry.kind,
                f"{entry.status_before or '—'} → {entry.status_after}",
                entry.generation,
                entry.attempts,
                entry.actor,
                f"reason: {entry.reason}"
                if entry.reason
                else error_html(entry.error_type, entry.error_message, entry.error_traceback),
                said.pop(entry.attempts, "") if ends_claim(entry) else "",
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
