"""The distribution installs one import package, `kvbatch`, whose modules import each other
without cycles and without reaching into another sub-package's private names.

The folders at the top of the repository (engine/, jobs/, worker/, kvkernels/, benchmarks/) are
mapped to kvbatch.engine, kvbatch.jobs, ... in pyproject.toml; a bare `import engine` would load
a second copy of a module (and shadow any other project's `engine`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
BARE_NAMES = {"engine", "jobs", "worker", "kvkernels", "benchmarks", "kernels", "bench"}


def _folder(package: str) -> Path:
    """The folder of a dotted package name, through the package-dir mapping."""
    for prefix in sorted(PACKAGE_DIR, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            rest = package[len(prefix) :].lstrip(".")
            return (
                ROOT / PACKAGE_DIR[prefix] / Path(*rest.split("."))
                if rest
                else ROOT / PACKAGE_DIR[prefix]
            )
    raise AssertionError(f"{package} has no package-dir entry")


def _modules() -> dict[str, Path]:
    """Every module of the distribution: dotted name -> file."""
    out = {}
    for package in SETUPTOOLS["packages"]:
        folder = _folder(package)
        for path in folder.glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def test_package_list_matches_the_tree():
    found = set()
    for prefix, folder in PACKAGE_DIR.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([prefix, *rel]))
    assert sorted(found) == sorted(SETUPTOOLS["packages"]), (
        "pyproject.toml's [tool.setuptools] packages must list every package folder"
    )


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import in a file, inside functions too."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return found


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(name, path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            if len(targets) < len(names) or not names:
                targets.append(module)
            graph[name] |= {t for t in targets if t in MODULES and t != name}
    return graph


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import, function-level ones included."""
    graph = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _subpackage(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["kvbatch", "engine"] else ".".join(parts[:2])


def test_no_bare_or_private_imports_across_packages():
    problems = []
    for name, path in MODULES.items():
        for module, names, line in _imports(name, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module.split(".")[0] in BARE_NAMES:
                problems.append(f"{where}: bare `{module}` (import it as kvbatch.…)")
            if module.startswith("kvbatch") and _subpackage(module) != _subpackage(name):
                private = [n for n in names if n.startswith("_")]
                if private or any(p.startswith("_") and p != "__init__" for p in module.split(".")):
                    problems.append(f"{where}: private {private or module} from {module}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_wheel_holds_one_top_level_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("kvbatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"kvbatch"}, top
    assert "kvbatch/engine/core/llm.py" in names and "kvbatch/kernels/rms_norm.py" in names
