"""Dependencies point one way: worker -> index -> broker -> jobs -> engine -> kernels.

Every import in kvbatch/ is read from the source (inside functions too, and
`importlib.import_module("kvbatch....")` with a literal name), so a layer that reaches up, even
lazily to dodge a cycle, fails here with the file and line. A module outside the layers
(kvbatch/redact.py, threads.py, engine_args.py, ...) counts as the highest layer it imports,
transitively, so it cannot smuggle an upward import through. The `kvbatch` command (cli.py) and
bench/ sit above every layer; no layer may import them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvbatch"
LAYERS = ("kernels", "engine", "jobs", "broker", "index", "worker")
ABOVE_ALL = ("cli", "bench")
TOP = len(LAYERS)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if not MODULES[module].name == "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def imports_of(module: str) -> tuple[tuple[str, int], ...]:
    """(imported kvbatch module, line) for every import in `module`'s source."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            found.append((base, node.lineno))
            # `from kvbatch.worker import tasks` imports a module, not only a package
            found += [
                (f"{base}.{alias.name}", node.lineno)
                for alias in node.names
                if f"{base}.{alias.name}" in MODULES
            ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, node.lineno))
    return tuple((name, line) for name, line in found if name.split(".")[0] == "kvbatch")


def _known(name: str) -> str | None:
    """The module of kvbatch that `name` names (a module, or an attribute of one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _own_layer(module: str) -> int | None:
    """A layered module's rank; TOP + 1 for the command and bench; None outside the layers."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    if parts[1] in ABOVE_ALL:
        return TOP + 1
    return None


def rank(module: str, seen: frozenset[str] = frozenset()) -> int:
    """The layer a module stands in: its own, or for a module outside the layers the highest
    layer it imports (-1: none)."""
    own = _own_layer(module)
    if own is not None:
        return own
    ranks = [-1]
    for name, _ in imports_of(module):
        target = _known(name)
        if target and target != module and target not in seen:
            ranks.append(rank(target, seen | {module}))
    return max(ranks)


def upward_imports() -> list[str]:
    found = []
    for module in sorted(MODULES):
        own = _own_layer(module)
        if own is None or own > TOP:
            continue
        for name, line in imports_of(module):
            target = _known(name)
            if target and rank(target) > own:
                found.append(f"{module}:{line} imports {target} (a layer above {LAYERS[own]})")
    return found


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports() == []


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """The check itself can fail: a lazy `import kvbatch.worker...` in an index module is caught."""
    module = "kvbatch.index.cli"
    source = MODULES[module].read_text(encoding="utf-8")
    planted = tmp_path / "cli.py"
    planted.write_text(source + "\n\ndef _late():\n    from kvbatch.worker import tasks\n")
    monkeypatch.setitem(MODULES, module, planted)
    imports_of.cache_clear()
    try:
        found = [line for line in upward_imports() if "kvbatch.worker.tasks" in line]
    finally:
        imports_of.cache_clear()
    assert found and "a layer above index" in found[0]


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_exists(layer):
    assert (PACKAGE / layer / "__init__.py").exists()
