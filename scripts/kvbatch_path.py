"""Make `import kvbatch.engine` work from a bare checkout, without `pip install`.

The repository's top-level folders install as one package through setuptools' package-dir
mapping (engine/ -> kvbatch.engine, kvkernels/ -> kvbatch.kernels, ...), so the checkout's
own root on sys.path only finds the CLI folder kvbatch/, which has no `engine` inside. The GPU
machine runs the checks from a plain copy with no network to install from. This builds the
installed layout as symlinks in a folder of its own, read from pyproject.toml so that it
follows the mapping:

    DEST/kvbatch/            a real folder: the entries of ./kvbatch linked one by one
    DEST/kvbatch/engine  ->  ./engine
    DEST/kvbatch/kernels ->  ./kvkernels   ...

and prints DEST; put it first on PYTHONPATH:

    export PYTHONPATH="$(python3 scripts/kvbatch_path.py):$PWD"

Every module is the checkout's own file (edits show at once); nothing is copied or written
into the checkout. pytest puts the repository root first on sys.path (pyproject's
`pythonpath` and the tests' rootdir), where ./kvbatch would hide DEST/kvbatch: run it with
`-o pythonpath= --import-mode=append` there (scripts/gpu-check.sh does).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"__pycache__"}  # each interpreter writes its own; a link would share a stale one


def package_dirs(pyproject: str) -> dict[str, str]:
    """pyproject.toml's [tool.setuptools.package-dir]: package name -> folder.

    Read with a pattern rather than tomllib, which Python 3.10 (still supported) lacks; the
    table holds only `"name" = "folder"` lines."""
    match = re.search(
        r"^\[tool\.setuptools\.package-dir\]\s*$(.*?)(?=^\[|\Z)", pyproject, re.M | re.S
    )
    if match is None:
        raise ValueError("pyproject.toml has no [tool.setuptools.package-dir] table")
    pairs = re.findall(r'^\s*"([\w.]+)"\s*=\s*"([^"]+)"', match.group(1), re.M)
    if not pairs:
        raise ValueError("[tool.setuptools.package-dir] maps no package")
    return dict(pairs)


def link_packages(root: Path, dest: Path, mapping: dict[str, str]) -> None:
    """Lay out `mapping`'s packages under `dest` as links into `root`.

    A package with another mapped package inside it becomes a real folder whose entries are
    links (so the inner one can be added beside them); any other package is one link to its
    folder."""
    for name in sorted(mapping, key=lambda n: n.count(".")):
        target = dest.joinpath(*name.split("."))
        source = root / mapping[name]
        if not (source / "__init__.py").is_file():
            raise ValueError(f"package-dir maps {name} to {mapping[name]}/, which is no package")
        nested = any(other.startswith(name + ".") for other in mapping)
        if not nested:
            target.symlink_to(source, target_is_directory=True)
            continue
        target.mkdir(parents=True)
        inner = {
            other.split(".")[name.count(".") + 1]
            for other in mapping
            if other.startswith(name + ".")
        }
        for entry in source.iterdir():
            if entry.name not in SKIPPED and entry.name not in inner:
                (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def build(dest: Path, root: Path = ROOT) -> Path:
    """Link the checkout at `root` into `dest` (which must be empty or absent); returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty: give a new or empty folder")
    link_packages(root, dest, package_dirs((root / "pyproject.toml").read_text()))
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", nargs="?", type=Path, help="an empty folder (default: a new temp one)")
    args = ap.parse_args(argv)
    dest = args.dest or Path(tempfile.mkdtemp(prefix="kvbatch-path-"))
    try:
        print(build(dest.resolve()))
    except ValueError as e:
        print(f"kvbatch_path: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
