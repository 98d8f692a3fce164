"""The documentation's Python examples, run against the test database.

A block runs when the HTML comment right above its fence carries ``run``
(``<!-- example: run -->``). A page's blocks run in order in one namespace, after the
tutorial's block marked ``setup``, so they may use the names it defines. The README's
block marked ``first`` stands alone; ``tests/docs/test_readme_example.py`` runs it. A page
with a block marked ``http`` also gets ``base_url`` (the agent API at the setup's
community host on the live server) and ``served_at`` (that server's address).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.db import connections

from tests.support.markdown_examples import blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PAGES = [page for page in PAGES if "_build" not in page.parts]
TUTORIAL = ROOT / "docs" / "tutorial.md"

# Worker threads of the consumer examples open connections of their own: the rows
# must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def _runnable(page: Path) -> list[str]:
    return [code for tags, code in blocks(page) if "run" in tags and "setup" not in tags]


def _setup() -> str:
    (code,) = [code for tags, code in blocks(TUTORIAL) if "setup" in tags]
    return code


def _label(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_label)
def test_the_page_s_examples_run(page: Path, request, settings) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_example_{page.stem}"}
    if any("http" in tags for tags, _ in blocks(page)):
        # The live server runs in a thread of this process and reads these settings.
        settings.ALLOWED_HOSTS = ["*"]
        port = int(request.getfixturevalue("live_server").url.rsplit(":", 1)[1])
        namespace["served_at"] = ("127.0.0.1", port)
        namespace["base_url"] = f"http://acme.example:{port}/agents/"
    try:
        exec(compile(_setup(), f"{_label(TUTORIAL)} (setup)", "exec"), namespace)
        for number, code in enumerate(_runnable(page), 1):
            exec(compile(code, f"{_label(page)} example {number}", "exec"), namespace)
    finally:
        # A consumer's threads close their own; this thread's stays for the flush.
        for alias in connections:
            if alias != "default":
                connections[alias].close()


def test_every_python_example_is_marked() -> None:
    """An unmarked Python block would be neither run nor reported."""
    for page in PAGES:
        text = page.read_text()
        fences = len(re.findall(r"^```python$", text, re.M))
        assert fences == len(blocks(page)), f"{_label(page)}: a ```python block has no marker"


def test_the_setup_and_lifecycle_blocks_are_where_the_host_check_reads_them() -> None:
    tags = [names for names, _ in blocks(TUTORIAL)]
    assert sum("settings" in names for names in tags) == 1
    assert sum("setup" in names for names in tags) == 1
    assert sum("lifecycle" in names for names in tags) >= 2
