"""The maps in docs/contributing.md. The code's: it names every module of the app, each
module says its job in its docstring, and no module imports from a floor above its
own. The tests': every test module sits in a folder the page names, none loose in
``tests/`` or among the helpers of ``tests/support/``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "workflow_delivery"
MAP = ROOT / "docs" / "contributing.md"
# A row of the map: | floor (blank: the row above's) | `module` | its job |
TESTS = ROOT / "tests"
ROW = re.compile(r"^\|\s*(?P<floor>[^|]*?)\s*\|\s*`(?P<module>[^`]+)`\s*\|", re.MULTILINE)
# A row of the tests' map: | `tests/<folder>/` | its tests |
FOLDER_ROW = re.compile(r"^\|\s*`tests/(?P<folder>[^`/]+)/`\s*\|", re.MULTILINE)
# exceptions finds WorkflowDeliveryConfigurationError in conf on first use.
ALLOWED_UPWARD = {("exceptions", "conf")}


def app_modules() -> list[Path]:
    """Every module of the app but migrations, commands (their own reference page)
    and empty package markers."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP)
        if relative.parts[0] in {"migrations", "management"}:
            continue
        if path.name == "__init__.py" and not path.read_text().strip():
            continue
        found.append(path)
    return found


def dotted(path: Path) -> str:
    """``services/holder.py`` as ``services.holder``; a package as its own name."""
    return (
        path.relative_to(APP).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
    )


def section(title: str) -> str:
    """The text of the page's ``## title`` section, up to the next one."""
    text = MAP.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def floors() -> dict[str, int]:
    """Each mapped module (dotted; a package's ``__init__`` under the package's name)
    and the number of its floor, the lowest 0."""
    numbered: dict[str, int] = {}
    floor = -1
    for row in ROW.finditer(section("Where the code lives")):
        if row["floor"]:
            floor += 1
        numbered[row["module"].removesuffix(".py").replace("/", ".")] = floor
    return numbered


def floor_of(module: str, numbered: dict[str, int]) -> int | None:
    """The floor of ``module``, or of the package it belongs to when the map names the
    package's modules one by one (its ``__init__`` re-exports them: the highest)."""
    if module in numbered:
        return numbered[module]
    inside = [floor for name, floor in numbered.items() if name.startswith(module + ".")]
    return max(inside) if inside else None


def imported(path: Path) -> set[str]:
    """The app modules ``path`` imports relatively (``from .x import y``: ``x``, or
    ``x.y`` when ``y`` is itself a module), at any depth of the file."""
    package = dotted(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                candidate = f"{target}.{alias.name}".lstrip(".")
                module = (
                    candidate
                    if (APP / candidate.replace(".", "/")).exists()
                    or (APP / (candidate.replace(".", "/") + ".py")).exists()
                    else target
                )
                found.add(module)
    return found


def test_every_module_has_a_line_in_the_map():
    numbered = floors()
    assert "store.statements" in numbered
    # A package's __init__ re-exports its modules, which have their own lines.
    modules = [dotted(path) for path in app_modules() if path.name != "__init__.py"]
    missing = sorted(name for name in modules if name not in numbered)
    assert not missing


def test_every_module_says_its_job():
    silent = [
        path.relative_to(APP).as_posix()
        for path in app_modules() + sorted((APP / "management" / "commands").glob("[!_]*.py"))
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not silent


def test_no_module_imports_from_a_floor_above_its_own():
    numbered = floors()
    assert numbered["protocol"] == 0 and numbered["store.statements"] > numbered["models"]
    upward = []
    for path in app_modules():
        module = dotted(path)
        own = floor_of(module, numbered)
        if own is None:
            continue
        for target in imported(path):
            theirs = floor_of(target, numbered)
            if theirs is not None and theirs > own and (module, target) not in ALLOWED_UPWARD:
                upward.append(f"{module} -> {target}")
    assert not upward


def test_no_test_module_sits_loose_in_tests_or_among_the_helpers():
    loose = sorted(path.name for path in TESTS.glob("test_*.py"))
    in_support = sorted(path.name for path in (TESTS / "support").rglob("test_*.py"))
    assert not loose, "move them into the folder of their layer (docs/contributing.md)"
    assert not in_support, "tests/support/ holds helpers, never a test module"


def test_every_test_folder_is_a_package_with_a_line_in_the_map():
    documented = set(FOLDER_ROW.findall(section("Where the tests live")))
    assert {"unit", "store", "services", "api", "support"} <= documented
    folders = {
        path.name for path in TESTS.iterdir() if path.is_dir() and path.name != "__pycache__"
    }
    folders -= {"screenshots"}  # the browser test's output, ignored by git
    assert folders == documented
    assert not [name for name in sorted(folders) if not (TESTS / name / "__init__.py").is_file()]
