"""The package's shape: no import cycles, and every module's public surface declared and respected.

Read statically (AST), lazy imports included, so a cycle that only bites at call time is caught
too. A name another module uses must be in its module's ``__all__``; everything else is internal.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness.multiprocess import REPO_ROOT

PACKAGE = "megatron_plugins"
USERS = (PACKAGE, "tests", "tools", "examples", "benchmarks")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {_module_name(path): path for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _owner(target: str) -> str | None:
    """The package module a dotted import target lives in."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _imports(name: str, tree: ast.Module) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in its code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                if MODULES[name].name != "__init__.py":
                    parts = parts[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            owner = _owner(target) if target.startswith(PACKAGE) else None
            if owner and owner != name and not name.startswith(owner + "."):
                found.add(owner)
    return found


def _cycles() -> list[list[str]]:
    edges = {name: _imports(name, tree) for name, tree in TREES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(edges[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    return cycles


def _declared(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)):
            return list(ast.literal_eval(node.value))
    return None


def _top_level(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _uses() -> list[tuple[str, str, str]]:
    """``(user file, package module, name)`` for every name one file takes from another module."""
    uses = []
    for root in USERS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            me = _module_name(path)
            aliases = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module in MODULES:
                    for alias in node.names:
                        submodule = f"{node.module}.{alias.name}"
                        if submodule in MODULES:
                            aliases[alias.asname or alias.name] = submodule
                        elif node.module != me:
                            uses.append((str(path.relative_to(REPO_ROOT)), node.module,
                                         alias.name))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name in MODULES and alias.asname:
                            aliases[alias.asname] = alias.name
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in aliases and aliases[node.value.id] != me):
                    uses.append((str(path.relative_to(REPO_ROOT)), aliases[node.value.id],
                                 node.attr))
    return uses


def test_the_package_has_no_import_cycle():
    assert len(MODULES) > 30  # the whole package was read
    assert _cycles() == []


def test_the_cycle_finder_sees_lazy_imports(tmp_path):
    lazy = ast.parse("def f():\n    from megatron_plugins.parallel.layout import LANGUAGE\n")
    assert "megatron_plugins.parallel.layout" in _imports("megatron_plugins.launch.plan", lazy)


def test_every_module_declares_its_public_names():
    undeclared = [name for name, tree in TREES.items() if _declared(tree) is None]
    assert undeclared == []
    unknown = {name: sorted(set(_declared(tree)) - _top_level(tree))
               for name, tree in TREES.items()}
    assert {name: missing for name, missing in unknown.items() if missing} == {}


def test_other_modules_use_only_declared_names():
    declared = {name: set(_declared(tree) or ()) for name, tree in TREES.items()}
    outside = sorted({(module, name, user) for user, module, name in _uses()
                      if name not in declared[module] and f"{module}.{name}" not in MODULES
                      and not (name.startswith("__") and name.endswith("__"))
                      and not (name.startswith("_") and not user.startswith(PACKAGE))})
    assert outside == []


LAYERS = ("errors", "cpu_simulation", "ops", "compat", "parallel", "media", "flops", "weights",
          "encoders", "data", "step", "peft", "model", "performance", "launch", "builder")
"""The package's rooms, lowest first: each may import only rooms before it (``builder`` is the
import path older saved configs name, kept for them)."""


def _room(module: str) -> str:
    return module.split(".")[1] if module != PACKAGE else PACKAGE


def _room_imports() -> dict[tuple[str, str], list[str]]:
    """``(room, imported room) -> [module -> module, ...]`` for every import across rooms."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, tree in TREES.items():
        for target in _imports(name, tree):
            if target != PACKAGE and _room(target) != _room(name):
                found.setdefault((_room(name), _room(target)), []).append(f"{name} -> {target}")
    return found


def test_every_room_of_the_package_is_in_the_layer_order():
    rooms = {_room(name) for name in MODULES if name != PACKAGE}
    assert rooms == set(LAYERS)


def test_rooms_import_only_the_rooms_below_them():
    upward = {pair: edges for pair, edges in _room_imports().items()
              if LAYERS.index(pair[1]) > LAYERS.index(pair[0])}
    assert upward == {}


def test_the_layer_check_sees_an_upward_import():
    tree = ast.parse("from megatron_plugins.launch.preflight import run\n")
    assert "megatron_plugins.launch.preflight" in _imports("megatron_plugins.data.mock", tree)
    assert LAYERS.index(_room("megatron_plugins.launch.preflight")) > LAYERS.index("data")
