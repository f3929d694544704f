"""The distribution installs one import package, `kvbatch`, whose folders are its import names
(kvbatch/engine is kvbatch.engine), whose modules import each other without cycles and without
reaching into another sub-package's private names, and which static tools can follow.

A top-level folder of ours named like another distribution's module would hide that module for
every test (the repository root is first on sys.path): it happened once, when our Triton kernels
sat in a top-level `kernels/` and transformers began importing Hugging Face's `kernels` package.
"""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvbatch"


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file, read from the tree itself."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def test_every_folder_of_the_package_is_a_package():
    """A folder of .py files without __init__.py would be left out of the wheel."""
    missing = [
        str(folder.relative_to(ROOT))
        for folder in {p.parent for p in PACKAGE.rglob("*.py")}
        if not (folder / "__init__.py").exists()
    ]
    assert not missing, f"add __init__.py to {missing}"


def test_no_installed_distribution_shares_our_top_level_names():
    ours = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    providers = importlib.metadata.packages_distributions()
    shared = {
        n: sorted(set(providers[n]) - {"kvbatch"})
        for n in ours
        if set(providers.get(n, ())) - {"kvbatch"}
    }
    assert not shared, f"these folders of ours hide installed distributions' modules: {shared}"


def test_the_installed_package_is_the_checkouts_folder():
    import kvbatch.engine

    assert Path(kvbatch.engine.__file__).resolve() == PACKAGE / "engine" / "__init__.py"


def test_an_editor_resolves_the_public_imports(tmp_path):
    """jedi (the completion engine of many editors, which reads files as pyright does, without
    running them) follows `kvbatch.engine`'s names to the files that define them."""
    jedi = pytest.importorskip("jedi")
    source = "from kvbatch.engine import LLM, SamplingParams\nfrom kvbatch.kernels import rms_norm\nLLM\nSamplingParams\n"
    script = jedi.Script(source, path=str(tmp_path / "user.py"), project=jedi.Project(str(ROOT)))
    where = {}
    for line, name in ((3, "LLM"), (4, "SamplingParams")):
        (definition,) = script.goto(line, 0, follow_imports=True)
        where[name] = Path(definition.module_path).relative_to(ROOT).as_posix()
    assert where == {
        "LLM": "kvbatch/engine/core/llm.py",
        "SamplingParams": "kvbatch/engine/core/sampling_params.py",
    }, where


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
            if module.startswith("kvbatch") and _subpackage(module) != _subpackage(name):
                private = [n for n in names if n.startswith("_")]
                if private or any(p.startswith("_") and p != "__init__" for p in module.split(".")):
                    problems.append(f"{where}: private {private or module} from {module}")
    assert not problems, "\n".join(problems)


def _engine_exports() -> set[str]:
    """The names `kvbatch.engine` exports, read from its __init__ (its `_EXPORTS` table)."""
    tree = ast.parse((PACKAGE / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("kvbatch/engine/__init__.py has no _EXPORTS table")


def test_jobs_and_worker_use_only_the_engines_public_api():
    """kvbatch.jobs and kvbatch.worker build on what `kvbatch.engine` exports, never on one of
    its modules: the engine's inside can then move without breaking them."""
    exports = _engine_exports()
    problems = []
    for name, path in MODULES.items():
        if not name.startswith(("kvbatch.jobs", "kvbatch.worker")):
            continue
        for module, names, line in _imports(name, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module.startswith("kvbatch.engine."):
                problems.append(f"{where}: imports {module}; use `from kvbatch.engine import ...`")
            elif module == "kvbatch.engine" and set(names) - exports:
                problems.append(f"{where}: {sorted(set(names) - exports)} not exported")
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


def test_every_package_file_is_tracked_by_git():
    """A file .gitignore hides (a `models/` pattern once matched kvbatch/engine/models/) works
    in the checkout that has it and is missing from every clone."""
    listed = subprocess.run(
        ["git", "ls-files", "kvbatch"], cwd=ROOT, capture_output=True, text=True
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = set(listed.stdout.split())
    untracked = sorted(
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if str(p.relative_to(ROOT)) not in tracked
    )
    ignored = subprocess.run(
        ["git", "check-ignore", *untracked], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert not ignored, f"git ignores these package files: {ignored}"
