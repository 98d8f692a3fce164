"""The admin overview's plot: settles per minute over the last hour, drawn server-side
as SVG (no JavaScript), from the deliveries' index of settled rows."""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .store import run, statements

WIDTH, HEIGHT, MARGIN = 720, 180, 30


def settles_per_minute(using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """60 counts, oldest minute first; the last is the minute now running."""
    return [count for _, count in run.fetch(using, statements.SETTLES_PER_MINUTE)]


def settles_plot(counts: list[int]) -> SafeString:
    """One bar per minute, the y axis labelled with the highest count."""
    top = max(counts, default=0) or 1
    step = (WIDTH - 2 * MARGIN) / max(len(counts), 1)
    usable = HEIGHT - 2 * MARGIN
    bars = format_html_join(
        "",
        '<rect x="{}" y="{}" width="{}" height="{}"><title>{} min ago: {} settled</title></rect>',
        (
            (
                f"{MARGIN + i * step:.1f}",
                f"{HEIGHT - MARGIN - usable * count / top:.1f}",
                f"{max(step - 1, 1):.1f}",
                f"{usable * count / top:.1f}",
                len(counts) - 1 - i,
                count,
            )
            for i, count in enumerate(counts)
        ),
    )
    return format_html(
        '<svg class="wd-settles" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'viewBox="0 0 {w} {h}" role="img" aria-label="settles per minute, last hour">'
        '<line x1="{m}" y1="{base}" x2="{right}" y2="{base}" stroke="#888"/>'
        '<line x1="{m}" y1="{m}" x2="{m}" y2="{base}" stroke="#888"/>'
        '<text x="2" y="{m}" font-size="11">{top}</text>'
        '<text x="2" y="{base}" font-size="11">0</text>'
        '<text x="{m}" y="{h}" font-size="11">60 min ago</text>'
        '<text x="{nowx}" y="{h}" font-size="11">now</text>'
        '<g fill="#417690">{bars}</g></svg>',
        w=WIDTH,
        h=HEIGHT - 4,
        m=MARGIN,
        base=HEIGHT - MARGIN,
        right=WIDTH - MARGIN,
        nowx=WIDTH - MARGIN - 20,
        top=top,
        bars=bars,
    )
