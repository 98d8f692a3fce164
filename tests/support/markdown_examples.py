"""The Python examples of a Markdown page, each with the tags of the HTML comment above its
fence (``<!-- example: run -->``)."""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"<!-- example: ([\w, -]+) -->\n```python\n(.*?)```", re.S)
TAGS = {"run", "setup", "settings", "lifecycle", "http", "first"}


def blocks(page: Path) -> list[tuple[set[str], str]]:
    found = []
    for tags, code in BLOCK.findall(page.read_text()):
        names = {tag.strip() for tag in tags.split(",")}
        unknown = names - TAGS
        assert not unknown, f"{page.name}: unknown example tags {sorted(unknown)}"
        found.append((names, code))
    return found
