"""Every migration carries the SQL it runs: none reads text or helpers from another module
of the app, so editing one migration (or the app's code) never changes what an earlier one
does. Checked on the source, without importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MIGRATIONS = Path(__file__).resolve().parents[2] / "workflow_delivery" / "migrations"
FILES = sorted(path for path in MIGRATIONS.glob("[0-9]*.py"))

# Importing these loads a module by a name computed at run time.
DYNAMIC_IMPORTS = {"importlib", "imp", "runpy", "pkgutil"}


def _problems(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                found.append(f"line {node.lineno}: relative import from {'.' * node.level}{module}")
            elif module.split(".")[0] in {"workflow_delivery", *DYNAMIC_IMPORTS}:
                found.append(f"line {node.lineno}: imports from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in {"workflow_delivery", *DYNAMIC_IMPORTS}:
                    found.append(f"line {node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in {"__import__", "import_module", "exec", "eval"}:
                found.append(f"line {node.lineno}: calls {name}()")
    return found


def test_there_are_migrations_to_check():
    assert len(FILES) >= 15, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_migration_imports_no_other_migration(path: Path):
    problems = _problems(path.read_text())
    assert not problems, f"{path.name} is not self-contained:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .fence import FUNCTIONS", "relative import"),
        ("from workflow_delivery.migrations import x", "imports from workflow_delivery"),
        ("import workflow_delivery.models", "imports workflow_delivery.models"),
        ("import importlib", "imports importlib"),
        ("from importlib import import_module", "imports from importlib"),
        ("m = __import__('workflow_delivery.migrations.0003_x')", "calls __import__()"),
        ("m = loader.import_module('x')", "calls import_module()"),
    ],
)
def test_the_check_sees_each_way_of_reading_another_module(source: str, expected: str):
    assert any(expected in problem for problem in _problems(source)), _problems(source)


def test_the_check_lets_django_and_the_standard_library_through():
    source = "import uuid\nimport django.db.models.deletion\nfrom django.db import migrations\n"
    assert _problems(source) == []
