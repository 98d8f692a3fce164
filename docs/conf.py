"""Sphinx configuration of the documentation site (pages in MyST Markdown).

Build: ``.venv/bin/sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import re
from pathlib import Path

_version = Path(__file__).resolve().parent.parent / "workflow_delivery" / "__init__.py"

project = "buzz workflow delivery"
author = "Buzz maintainers"
copyright = "Buzz maintainers"
release = re.search(r'__version__ = "([^"]+)"', _version.read_text()).group(1)
version = release

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Headings become link targets (``page.md#heading``) down to the third level.
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

html_theme = "alabaster"
html_title = "buzz workflow delivery"
html_static_path: list[str] = []
