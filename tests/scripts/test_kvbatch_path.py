"""scripts/kvbatch_path.py: a bare checkout imports as the installed `kvbatch` package.

The GPU machine runs the checks from a plain copy of the repository, with no `pip install`.
These start interpreters that cannot see the installed (editable) package: `-S` skips site's
.pth files, so only the folders on PYTHONPATH are searched, the link farm first.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
kvbatch_path = load_script("kvbatch_path")


def bare_python(path: list[Path], code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter whose only package folders are `path` and the
    site-packages holding torch (without the .pth file of kvbatch's editable install)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*path, *site.getsitepackages()]))
    env["PYTHONSAFEPATH"] = "1"
    return subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


IMPORTS = """
import kvbatch.engine.core.llm as llm, kvbatch.kernels.rms_norm as rms, kvbatch.bench.cli
import os, sys
print(os.path.realpath(llm.__file__))
print(os.path.realpath(rms.__file__))
print(sorted(m for m in sys.modules if m.split('.')[0] in {'engine', 'kvkernels', 'benchmarks'}))
"""


def test_the_link_farm_imports_this_tree_s_modules(tmp_path):
    farm = kvbatch_path.build(tmp_path / "ns")
    r = bare_python([farm], IMPORTS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    llm, rms, bare = r.stdout.splitlines()
    assert llm == str(ROOT / "engine" / "core" / "llm.py")
    assert rms == str(ROOT / "kvkernels" / "rms_norm.py")
    assert bare == "[]"  # no module loaded under a bare name, so none twice


def test_without_it_the_checkout_alone_has_no_engine(tmp_path):
    """Why the farm exists: the root's kvbatch/ is the CLI folder, with no engine inside."""
    r = bare_python([ROOT], "import kvbatch.engine", cwd=tmp_path)
    assert r.returncode != 0 and "No module named 'kvbatch.engine'" in r.stderr


def test_the_layout_follows_pyproject_s_mapping(tmp_path):
    farm = kvbatch_path.build(tmp_path / "ns")
    mapping = kvbatch_path.package_dirs((ROOT / "pyproject.toml").read_text())
    assert mapping["kvbatch.kernels"] == "kvkernels" and mapping["kvbatch"] == "kvbatch"
    for name, folder in mapping.items():
        linked = farm.joinpath(*name.split("."))
        assert (linked / "__init__.py").resolve() == (ROOT / folder / "__init__.py").resolve()
    assert (farm / "kvbatch").is_dir() and not (farm / "kvbatch").is_symlink()
    assert not (ROOT / "kvbatch" / "engine").exists()  # nothing written into the checkout


def test_a_used_folder_or_a_bad_mapping_is_refused(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert kvbatch_path.main([str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="package-dir"):
        kvbatch_path.package_dirs('[project]\nname = "x"\n')
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"kvbatch" = "missing"\n')
    with pytest.raises(ValueError, match="no package"):
        kvbatch_path.build(tmp_path / "ns", root)
