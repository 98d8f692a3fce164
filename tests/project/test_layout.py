"""The maps in docs/contributing.md. The code's: it names every module of the app and
nothing else, each module says its job in its docstring, no module imports from a floor
above its own, each folder of the app is on the one floor the map gives it, and the
modules outside ``services/`` and ``store/`` change no state of the app's tables. The
tests': every test module sits in a folder the page names, none loose in ``tests/`` or
among the helpers of ``tests/support/``."""

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
# Each folder of the app and the floor its modules are on (the start of the floor's name
# in the map): the folder is the floor's, or one of its floor's.
FOLDER_FLOORS = {
    "store": "persistence",
    "services": "state changes",
    "api": "HTTP API",
    "admin": "admin",
    "acp": "agents' and operators' tools",
    "management": "commands",
}
# The ORM calls that write; outside services/ and store/ none may be called on a manager
# or queryset of the app's models.
ORM_WRITES = {
    "bulk_create",
    "bulk_update",
    "create",
    "delete",
    "get_or_create",
    "save",
    "update",
    "update_or_create",
}
# What SQL that changes state says (a write, a notification, an advisory lock, a setting).
WRITING_SQL = re.compile(
    r"\b(INSERT|UPDATE|DELETE|MERGE|TRUNCATE|pg_notify|pg_advisory\w*|set_config)\b"
    r"|\bFOR\s+(NO\s+KEY\s+)?(UPDATE|SHARE)\b",
    re.IGNORECASE,
)


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


def map_rows() -> list[tuple[str, int, str]]:
    """Each row of the code's map: its module as written, the number of its floor (the
    lowest 0) and the floor's name."""
    rows = []
    floor, name = -1, ""
    for row in ROW.finditer(section("Where the code lives")):
        if row["floor"]:
            floor, name = floor + 1, row["floor"]
        rows.append((row["module"], floor, name))
    return rows


def floors() -> dict[str, int]:
    """Each mapped module (dotted; a package's ``__init__`` under the package's name)
    and the number of its floor, the lowest 0."""
    return {module.removesuffix(".py").replace("/", "."): floor for module, floor, _ in map_rows()}


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


def test_every_line_of_the_map_names_a_module_or_folder_of_the_app():
    rows = map_rows()
    assert len(rows) > 40
    stale = [module for module, _, _ in rows if not (APP / module).exists()]
    assert not stale


def misplaced(rows: list[tuple[str, int, str]]) -> list[str]:
    """The map's lines under a folder of ``FOLDER_FLOORS`` that are on another floor."""
    found = []
    for folder, expected in FOLDER_FLOORS.items():
        lines = [(module, name) for module, _, name in rows if module.startswith(folder + "/")]
        if not lines:
            found.append(f"the map has no line under {folder}/")
        found += [
            f"{module} is on the floor {name!r}, not {expected!r}"
            for module, name in lines
            if not name.startswith(expected)
        ]
    return found


def test_each_folder_is_on_the_floor_the_map_gives_it():
    folders = {path.relative_to(APP).parts[0] for path in APP.rglob("*.py")}
    folders -= {"migrations", *(path.name for path in APP.glob("*.py"))}
    # Every folder of the app has its floor here (a new folder needs a line above).
    assert folders == set(FOLDER_FLOORS)
    assert not misplaced(map_rows())


def test_the_folder_check_fails_for_a_module_on_another_floor():
    moved = [
        (module, floor, "state changes" if module == "store/run.py" else name)
        for module, floor, name in map_rows()
    ]
    assert misplaced(moved) == ["store/run.py is on the floor 'state changes', not 'persistence'"]
    assert misplaced([row for row in moved if not row[0].startswith("acp/")]) == [
        "store/run.py is on the floor 'state changes', not 'persistence'",
        "the map has no line under acp/",
    ]


def _chain(node: ast.AST) -> list[str]:
    """``Community.objects.using(x).create`` as its names: Community, objects, using,
    create."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def orm_writes(source: str) -> list[str]:
    """The ORM writes of ``source`` on a manager's queryset (``X.objects....create()``),
    but for Django's own admin log (``LogEntry``), which is the admin's table."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            names = _chain(node.func)
            if node.func.attr in ORM_WRITES and "objects" in names and names[0] != "LogEntry":
                found.append(".".join(names))
    return found


def statement_writes(source: str) -> list[str]:
    """The statements of ``store.statements`` that ``source`` names and that change
    state."""
    from workflow_delivery.store import statements

    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "statements"
        ):
            value = getattr(statements, node.attr, "")
            texts = value.values() if isinstance(value, dict) else [value]
            for text in texts:
                if WRITING_SQL.search(getattr(text, "text", text) if text else ""):
                    found.append(node.attr)
    return found


def test_no_module_outside_services_and_store_changes_state():
    writers = []
    for path in app_modules():
        if path.relative_to(APP).parts[0] in {"services", "store"}:
            continue
        source = path.read_text()
        module = dotted(path)
        writers += [f"{module}: {call}" for call in orm_writes(source)]
        writers += [f"{module}: statements.{name}" for name in statement_writes(source)]
    assert not writers


def test_the_state_check_finds_writes():
    # The checks above can fail: an ORM write, a writing statement, and the admin log
    # that is allowed.
    assert orm_writes("Community.objects.using(alias).create(host=h)") == [
        "Community.objects.using.create"
    ]
    assert orm_writes("LogEntry.objects.create(user_id=1)") == []
    assert orm_writes("Community.objects.filter(id=1).first()") == []
    assert statement_writes("run.execute(c, statements.REVOKE_AGENT)") == ["REVOKE_AGENT"]
    assert statement_writes("run.fetch(u, statements.TARGET_STATE)") == []


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
