"""Tier 1 (pure): the package layout holds — import direction, no cycles, a torch-free core, short functions.

The rules are the package map of docs/architecture.md: each package may import only the packages
listed for it, so the data flow reads off the folders (schema → core → report; capture → costs →
run; api and cli on top).
"""

from __future__ import annotations

import ast
import re
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
    "workers": set(),
    "capture": {"errors", "schema", "torch_compat", "threads"},
    "costs": {"errors", "schema", "core", "capture", "torch_compat", "threads", "workers"},
    "data": {"errors"},
    "run": {"errors", "schema", "core", "capture", "data", "torch_compat", "threads"},
    "api": {"errors", "schema", "core", "capture", "costs", "torch_compat", "threads", "workers"},
}
PURE = ("errors", "schema", "core", "report")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700
# at most this many parameters (self and cls not counted) for a function of the pure core: more
# means a record of the inputs that travel together is missing (planner/core/layout/inputs.py)
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


def _checked_sources() -> list[Path]:
    """The code the size limits apply to: the package, the command line (cli*.py) and the benches."""
    return sorted([*PLANNER.rglob("*.py"), *ROOT.glob("cli*.py"), *(ROOT / "bench").rglob("*.py")])


def test_no_function_longer_than_80_lines() -> None:
    long = []
    for path in _checked_sources():
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, source)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_module_longer_than_700_lines() -> None:
    """A module over ~700 lines holds more than one job: split it by job, as ``core/split/solve`` was."""
    long = [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in _checked_sources()
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


# --- private torch names -------------------------------------------------------------------------
# Every private torch API the planner touches goes through planner/torch_compat.py, the one file to
# mend when torch changes one (docs/architecture.md). "Private": a name starting with "_" that is not
# a dunder. Operator names under torch.ops (aten._softmax) are the operator registry's, not private.
TORCH_COMPAT = PLANNER / "torch_compat.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_torch_module(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def _torch_bound_names(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch or to something imported from it -> what they stand for."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_module(alias.name):
                    # ``import torch.x`` binds ``torch``; ``import torch.x as y`` binds ``y`` to torch.x
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch_module(node.module):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _attribute_chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"] (None: the chain does not start at a plain name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_torch_uses(tree: ast.Module) -> set[str]:
    """Every private torch name a module's code reaches (imports, attribute chains from a torch name,
    ``getattr``-family calls on one, and ``super()._x`` in a subclass of a torch class)."""
    bound = _torch_bound_names(tree)
    hits: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits.update(
                f"import {a.name}"
                for a in node.names
                if _is_torch_module(a.name) and any(map(_is_private, a.name.split(".")))
            )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch_module(node.module):
            assert node.module is not None
            if any(map(_is_private, node.module.split("."))) or any(_is_private(a.name) for a in node.names):
                hits.add(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain is None or chain[0] not in bound:
                continue
            full = [*bound[chain[0]].split("."), *chain[1:]]
            if full[:2] == ["torch", "ops"]:
                continue
            private = [k for k, part in enumerate(chain) if k > 0 and _is_private(part)]
            if private:
                hits.add(".".join(chain[: private[0] + 1]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                target, name = _attribute_chain(node.args[0]), node.args[1]
                if (
                    target is not None
                    and target[0] in bound
                    and isinstance(name, ast.Constant)
                    and isinstance(name.value, str)
                    and _is_private(name.value)
                ):
                    hits.add(f"{node.func.id}({'.'.join(target)}, {name.value!r})")
        elif isinstance(node, ast.ClassDef):
            bases = [_attribute_chain(b) for b in node.bases]
            if not any(b is not None and b[0] in bound for b in bases):
                continue
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Attribute)
                    and _is_private(inner.attr)
                    and isinstance(inner.value, ast.Call)
                    and isinstance(inner.value.func, ast.Name)
                    and inner.value.func.id == "super"
                ):
                    hits.add(f"{node.name}: super().{inner.attr}")
    return hits


def test_private_torch_names_only_in_torch_compat() -> None:
    found = []
    for path in [*sorted(PLANNER.rglob("*.py")), ROOT / "cli.py"]:
        if path == TORCH_COMPAT:
            continue
        for use in sorted(_private_torch_uses(ast.parse(path.read_text(), str(path)))):
            found.append(f"{path.relative_to(ROOT)}: {use}")
    assert not found, f"use these through planner/torch_compat.py: {found}"


def test_the_private_name_check_sees_each_kind_of_use() -> None:
    source = """
import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors
from torch.utils import _pytree
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

aten = torch.ops.aten
ok = (torch.ops.aten._softmax, torch.nn.Module.__call__, aten._unsafe_view, torch.compile)


def f(t, module):
    t._is_view()  # a tensor's method: not traceable by name (torch_compat.is_view)
    torch._dynamo.reset()
    dist.distributed_c10d._world
    getattr(torch.distributed.pipelining.schedules, "_batch_p2p")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, [])


class Agent(LocalElasticAgent):
    def _start_workers(self, group):
        return super()._start_workers(group)
"""
    assert _private_torch_uses(ast.parse(source)) == {
        "import torch._functorch.config",
        "from torch._utils import _flatten_dense_tensors",
        "from torch.utils import _pytree",
        "torch._dynamo",
        "dist.distributed_c10d._world",
        "getattr(torch.distributed.pipelining.schedules, '_batch_p2p')",
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        "Agent: super()._start_workers",
    }


# --- private attributes of torch objects, private torch names in strings -------------------------
# The check above follows names bound to torch. Two kinds of use escape it: a private attribute read
# on a torch *object* (an operator's ``func._schema``, a tensor's ``t._base``, a DTensor's
# ``_local_tensor``), which no import names, and a private torch module named in a string (the
# logger "torch._dynamo"). A private attribute read outside torch_compat must be one the planner
# defines itself; a string must not name a private torch module or attribute.
SOURCES = [*sorted(PLANNER.rglob("*.py")), *sorted(ROOT.glob("cli*.py"))]
# Private attributes of torch objects the planner has read: flagged even where a planner class calls
# one of its own by the same name, so that the name cannot hide a read of torch's.
TORCH_OBJECT_PRIVATES = frozenset(
    {"_base", "_buffers", "_local_tensor", "_modules", "_name", "_overloadpacket", "_parameters", "_schema", "_spec"}
)
# Another library's private attribute, read on an object the check cannot tell from a torch one:
# (file, name) -> whose it is. Not torch's, so not torch_compat's.
NOT_TORCH_PRIVATES: dict[tuple[str, str], str] = {
    ("planner/capture/tp_plan.py", "_tp_plan"): "Hugging Face transformers' PreTrainedModel._tp_plan",
}
_GETATTR_FAMILY = ("getattr", "setattr", "hasattr", "delattr")
# Keyword arguments whose string is documentation, like a docstring (pydantic's Field, click's options).
_DOC_KEYWORDS = ("description", "help")


def _names_bound_in(body: list[ast.stmt]) -> set[str]:
    """The names a module's or class's own statements bind (functions', classes' and their
    variables', at any depth of if / try / with / for, never inside a function)."""
    names: set[str] = set()
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)  # its body is another scope (a class's: the caller walks it)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "planner"):
            names.update(a.asname or a.name for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _own_private_names(trees: list[ast.Module]) -> set[str]:
    """Every private name the planner defines: its modules' functions, classes and variables, names
    imported from its own modules, class members and fields, ``self._x`` / ``cls._x`` assignments
    and ``setattr(self, "_x", ...)``; less the names of torch objects' private attributes."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef)):
                names |= _names_bound_in(node.body)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) >= 2
                and _is_self(node.args[0])
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                names.add(node.args[1].value)
    return {n for n in names if _is_private(n)} - TORCH_OBJECT_PRIVATES


def _imported_names(tree: ast.Module) -> set[str]:
    """Names bound by an import anywhere in a module, and names given a chain into ``torch.ops``
    (``aten = torch.ops.aten``): what is read through them is a module's attribute (the check above
    covers torch's) or an operator's name, not an object's private attribute."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    torch_names = _torch_bound_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _attribute_chain(node.value)
            if chain is not None and chain[0] in torch_names:
                if [*torch_names[chain[0]].split("."), *chain[1:]][:2] == ["torch", "ops"]:
                    names.add(node.targets[0].id)
    return names


def _chain_root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _private_attribute_reads(tree: ast.Module, own: set[str]) -> set[tuple[str, str]]:
    """Every private attribute a module reads, writes or calls on an object that is not one of the
    planner's own names (``own``): ``x._y`` and ``getattr(x, "_y")`` alike, whatever ``x`` is (a
    parameter, ``self`` of a subclass of a torch class, a call's result). Chains from an imported
    name are left to the check above. Each as (the expression, the private name)."""
    imported = _imported_names(tree)
    hits: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            target, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _GETATTR_FAMILY
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target, name = node.args[0], node.args[1].value
        else:
            continue
        root = _chain_root(target)
        if not _is_private(name) or name in own or (isinstance(root, ast.Name) and root.id in imported):
            continue
        hits.add((ast.unparse(node), name))
    return hits


def _documentation_strings(tree: ast.Module) -> set[int]:
    """``id`` of every string that documents rather than names: docstrings and the strings of a
    ``description=`` / ``help=`` keyword argument."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
        elif isinstance(node, ast.keyword) and node.arg in _DOC_KEYWORDS:
            found.update(id(inner) for inner in ast.walk(node.value) if isinstance(inner, ast.Constant))
    return found


def _dotted_names(text: str) -> list[str]:
    """The dotted names in a text (``a.b_c.d``), a sentence's closing full stop dropped."""
    spaced = "".join(c if c.isalnum() or c in "._" else " " for c in text)
    return [word.strip(".") for word in spaced.split()]


def _names_private_torch(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and parts[1:2] != ["ops"] and any(map(_is_private, parts[1:]))


def _private_torch_strings(tree: ast.Module) -> set[str]:
    """Every private torch module or attribute a string names (``"torch._dynamo"``,
    ``f"torch.distributed._tools.{x}"``), documentation aside; operators (``torch.ops``) are not private."""
    documentation = _documentation_strings(tree)
    hits: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation:
            hits.update(name for name in _dotted_names(node.value) if _names_private_torch(name))
    return hits


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_private_attributes_of_torch_objects_only_in_torch_compat() -> None:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in SOURCES if path != TORCH_COMPAT}
    own = _own_private_names(list(trees.values()))
    found = [
        f"{_relative(path)}: {use}"
        for path, tree in trees.items()
        for use, name in sorted(_private_attribute_reads(tree, own))
        if (_relative(path), name) not in NOT_TORCH_PRIVATES
    ]
    assert not found, f"read these through planner/torch_compat.py (or name the planner's own attribute): {found}"


def test_private_torch_names_in_strings_only_in_torch_compat() -> None:
    found = [
        f"{_relative(path)}: {name!r}"
        for path in SOURCES
        if path != TORCH_COMPAT
        for name in sorted(_private_torch_strings(ast.parse(path.read_text(), str(path))))
    ]
    assert not found, f"name these in planner/torch_compat.py: {found}"


def test_private_torch_names_only_in_torch_compat_in_every_cli_module() -> None:
    # the import-and-chain check above reads cli.py; its helpers cli_*.py are the same command
    found = [
        f"{_relative(path)}: {use}"
        for path in sorted(ROOT.glob("cli*.py"))
        for use in sorted(_private_torch_uses(ast.parse(path.read_text(), str(path))))
    ]
    assert not found, f"use these through planner/torch_compat.py: {found}"


def test_the_private_attribute_check_sees_each_kind_of_read() -> None:
    planner_module = """
from dataclasses import dataclass
from planner.capture.graph import _Tracer

_CACHE = {}


def _helper(x):
    return x


@dataclass
class Record:
    _hidden: int = 0

    def _method(self):
        self._made = 1
        setattr(self, "_set", 2)
        return self._hidden


class Tracer(_Tracer):
    def _base(self):  # one of torch's names: never the planner's own
        return self._buffers
"""
    user = """
import multiprocessing.forkserver
import torch
import torch.nn as nn
from planner.capture import graph

aten = torch.ops.aten


def f(func, t, dt, module, record, tracer):
    func._schema  # an operator's schema
    t._base  # a view's base tensor
    dt._local_tensor.shape  # a DTensor's local part
    module._parameters["weight"] = None  # written, not read: the same dependence
    getattr(func, "_overloadpacket", None)
    hasattr(t, "_version")
    nn.Linear(2, 2)._forward_hooks
    super()._start_workers()
    tracer._base()
    tracer._buffers
    # the planner's own names, imported modules' attributes, operators, dunders: not flagged
    ok = (record._hidden, record._method(), record._made, record._set, _CACHE, _helper(t), graph._Tracer)
    ok = (aten._softmax.default, torch.ops.aten._unsafe_view, multiprocessing.forkserver._forkserver)
    ok = (t.__class__, func.__name__, getattr(t, "__dict__"), getattr(t, "shape"))
"""
    own = _own_private_names([ast.parse(planner_module), ast.parse(user)])
    assert {"_CACHE", "_helper", "_Tracer", "_hidden", "_method", "_made", "_set"} <= own
    assert not own & {"_base", "_buffers"}
    assert {use for use, _ in _private_attribute_reads(ast.parse(user), own)} == {
        "func._schema",
        "t._base",
        "dt._local_tensor",
        "module._parameters",
        "getattr(func, '_overloadpacket', None)",
        "hasattr(t, '_version')",
        "nn.Linear(2, 2)._forward_hooks",
        "super()._start_workers",
        "tracer._base",
        "tracer._buffers",
    }


def test_the_private_string_check_sees_each_kind_of_name() -> None:
    source = '''
"""Module docstring: torch.distributed.pipelining._backward is documentation."""
import logging
from pydantic import Field

LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export")
logging.getLogger(f"torch._export.{__name__}")
CONFIG = "torch._inductor.config.compile_threads"
MESSAGE = "see torch.distributed._tools.mem_tracker."
ok = ("torch.ops.aten._softmax", "torch.__version__", "mytorch._x", "a.torch._y", "torch.nn.functional")


def f() -> None:
    """Mentions torch._functorch.config: documentation."""
    return Field(description="torch._functorch.config.donated_buffer=False", default=None)
'''
    assert _private_torch_strings(ast.parse(source)) == {
        "torch._dynamo",
        "torch._export",
        "torch._inductor.config.compile_threads",
        "torch.distributed._tools.mem_tracker",
    }


def test_every_module_is_in_the_architecture_map() -> None:
    """docs/architecture.md's module map has one line for every module of ``planner/`` and every
    ``cli*.py``, and no line for a module that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `([\w/]+)`:", section, flags=re.M))
    modules = {
        str(p.relative_to(PLANNER).with_suffix("")) for p in PLANNER.rglob("*.py") if p.name != "__init__.py"
    } | {p.stem for p in ROOT.glob("cli*.py")}
    assert not modules - listed, f"add to docs/architecture.md's module map: {sorted(modules - listed)}"
    assert not listed - modules, f"gone, remove from the module map: {sorted(listed - modules)}"
