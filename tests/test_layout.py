"""Tier 1 (pure): the package layout holds — import direction, no cycles, a torch-free core, short functions.

The rules are the package map of docs/architecture.md: each package may import only the packages
listed for it, so the data flow reads off the folders (schema → core → report; capture → costs →
run; api and cli on top).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "planner"

# package (first component below planner) -> the planner packages it may import (itself always)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "schema": {"errors"},
    "core": {"errors", "schema"},
    "report": {"errors", "schema", "core"},
    "torch_compat": set(),
    "threads": set(),
    "capture": {"errors", "schema", "torch_compat", "threads"},
    "costs": {"errors", "schema", "core", "capture", "torch_compat", "threads"},
    "data": {"errors"},
    "run": {"errors", "schema", "core", "capture", "data", "torch_compat", "threads"},
    "api": {"errors", "schema", "core", "capture", "costs", "torch_compat", "threads"},
}
PURE = ("errors", "schema", "core", "report")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700
# at most this many parameters (self and cls not counted) for a function of the pure core: more
# means a record of the inputs that travel together is missing (planner/core/inputs.py)
MAX_CORE_PARAMETERS = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PLANNER.rglob("*.py"))}


def _imports(name: str, tree: ast.Module) -> set[str]:
    """Every module this one imports, at any depth (function-level imports count too)."""
    found: set[str] = set()
    package = name if (ROOT / Path(*name.split("."))).is_dir() else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _planner_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    return {m for m in _imports(name, tree) if m in known and m != name}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_is_in_the_map() -> None:
    packages = {_package(m) for m in _modules()} - {""}
    assert packages == set(ALLOWED), "add the new package to ALLOWED and to docs/architecture.md"


def test_imports_follow_the_package_map() -> None:
    modules = _modules()
    bad = []
    for name, tree in modules.items():
        own = _package(name)
        if not own:
            continue
        for dep in _planner_imports(name, tree, set(modules)):
            target = _package(dep)
            if target and target != own and target not in ALLOWED[own]:
                bad.append(f"{name} imports {dep}")
    assert not bad, bad


def test_no_import_cycle_inside_planner() -> None:
    modules = _modules()
    graph = nx.DiGraph()
    for name, tree in modules.items():
        for dep in _planner_imports(name, tree, set(modules)):
            if not name.startswith(dep + "."):  # a module importing its own package's __init__
                graph.add_edge(name, dep)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_never_name_torch(package: str) -> None:
    for name, tree in _modules().items():
        if _package(name) == package:
            torchy = {m for m in _imports(name, tree) if m == "torch" or m.startswith("torch.")}
            assert not torchy, f"{name} imports {torchy}"


def test_pure_core_loads_without_torch() -> None:
    pure = [m for m in _modules() if _package(m) in PURE]
    code = (
        "import sys; import " + ", ".join(pure) + "; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Lines of code in a function: not blank, not a comment, not its docstring."""
    skip: set[int] = set()
    body = fn.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        skip.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    count = 0
    for lineno in range(fn.lineno, (fn.end_lineno or fn.lineno) + 1):
        text = source[lineno - 1].strip()
        if lineno not in skip and text and not text.startswith("#"):
            count += 1
    return count


def test_no_function_longer_than_80_lines() -> None:
    long = []
    for path in sorted([*PLANNER.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, source)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_module_longer_than_700_lines() -> None:
    """A module over ~700 lines holds more than one job: split it by job, as ``core/solve`` was."""
    long = [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in sorted(PLANNER.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, long


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def test_core_functions_take_few_parameters() -> None:
    many = []
    for path in sorted((PLANNER / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > MAX_CORE_PARAMETERS:
                many.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_parameters(node)})")
    assert not many, many


def test_bench_scripts_import_the_package_not_each_other() -> None:
    """bench/ is a package run as ``python -m bench.NAME``: no script edits ``sys.path`` or imports
    another script (shared code lives in its helper modules)."""
    bench = ROOT / "bench"
    scripts = {p.stem for p in bench.glob("*.py") if "__main__" in p.read_text()}
    hits = []
    for path in sorted(bench.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} uses sys.path")
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if (parts[0] == "bench" and len(parts) > 1 and parts[1] in scripts) or (
                    node.level and parts[0] in scripts
                ):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno} imports the script {node.module}")
            if isinstance(node, ast.Import):
                hits += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports the script {a.name}"
                    for a in node.names
                    if a.name.split(".")[:2] in (["bench", s] for s in scripts) or a.name in scripts
                ]
    assert not hits, hits


def test_code_and_docs_cite_nothing_outside_the_repository() -> None:
    hits = []
    for path in [
        *PLANNER.rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
        ROOT / "README.md",
        ROOT / "cli.py",
    ]:
        text = path.read_text()
        for needle in ("DESIGN.md", "REFERENCES.md", "../" + "shared"):  # spelled apart so this file does not cite it
            if needle in text and path != Path(__file__):
                hits.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not hits, hits
