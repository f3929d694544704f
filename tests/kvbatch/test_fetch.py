"""kvbatch.fetch: the pinned SmolLM2 files, and a cache that survives concurrent fetchers.

Most tests fetch a small fake wheel (pip replaced by a copy) so that they run in milliseconds;
the SmolLM2 tests use the real cache (downloaded once, ~93 MB, then reused).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from kvbatch import fetch
from kvbatch.fetch import FetchError, WheelFile, fetch_wheel_file, resolve_cache_dir

PAYLOAD = os.urandom(3000)
ITEM = WheelFile("fakepkg==1.0", "fakepkg/model.bin", hashlib.sha256(PAYLOAD).hexdigest())


@pytest.fixture
def fake_wheel(tmp_path_factory) -> Path:
    """A wheel holding ITEM, outside the test's tmp_path (which the tests use as cache)."""
    wheel = tmp_path_factory.mktemp("wheels") / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fakepkg/__init__.py", "")
        z.writestr(ITEM.member, PAYLOAD)
    return wheel


@pytest.fixture
def fake_pip(fake_wheel, monkeypatch) -> list[str]:
    """Replace `pip download` by a copy of fake_wheel; the list records each download."""
    calls = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        time.sleep(0.2)  # widen the window in which concurrent fetchers could collide
        return Path(shutil.copy(fake_wheel, dest))

    monkeypatch.setattr(fetch, "_pip_download", download)
    return calls


def test_cache_dir_is_argument_then_env_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVBATCH_CACHE", raising=False)
    assert resolve_cache_dir() == tmp_path / "home" / ".cache" / "kvbatch"
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert (tmp_path / "arg").is_dir()


def test_fetches_once_then_reuses_the_verified_file(tmp_path, fake_pip):
    path = fetch_wheel_file(ITEM, tmp_path)
    assert path == tmp_path / "model.bin" and path.read_bytes() == PAYLOAD
    assert fetch_wheel_file(ITEM, tmp_path) == path
    assert fake_pip == ["fakepkg==1.0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "model.bin",
        "model.bin.verified",
    ]


def test_a_changed_file_is_fetched_again(tmp_path, fake_pip):
    path = fetch_wheel_file(ITEM, tmp_path)
    path.write_bytes(b"x" * len(PAYLOAD))  # same size, other content and mtime
    assert fetch_wheel_file(ITEM, tmp_path).read_bytes() == PAYLOAD
    assert len(fake_pip) == 2


def test_a_file_put_in_by_hand_is_hashed_not_downloaded(tmp_path, fake_pip):
    (tmp_path / "model.bin").write_bytes(PAYLOAD)
    assert fetch_wheel_file(ITEM, tmp_path).read_bytes() == PAYLOAD
    assert fake_pip == [] and (tmp_path / "model.bin.verified").exists()


def test_a_wrong_hash_fails_and_leaves_nothing(tmp_path, fake_pip):
    bad = WheelFile(ITEM.requirement, ITEM.member, "0" * 64)
    with pytest.raises(FetchError, match="expected 0000"):
        fetch_wheel_file(bad, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_a_missing_member_is_named(tmp_path, fake_pip):
    with pytest.raises(FetchError, match="has no fakepkg/other.bin"):
        fetch_wheel_file(WheelFile(ITEM.requirement, "fakepkg/other.bin", ITEM.sha256), tmp_path)


def test_leftovers_of_a_killed_fetch_are_removed(tmp_path, fake_pip):
    (tmp_path / ".tmp-dl-dead").mkdir()
    (tmp_path / ".tmp-dl-dead" / "model.bin.part").write_bytes(b"half")
    (tmp_path / ".tmp-abc").write_text("half a marker")
    fetch_wheel_file(ITEM, tmp_path)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_concurrent_threads_download_once(tmp_path, fake_pip):
    results, errors = [], []

    def worker():
        try:
            results.append(fetch_wheel_file(ITEM, tmp_path))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [tmp_path / "model.bin"] * 4
    assert len(fake_pip) == 1


_CHILD = """
import importlib.util, shutil, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("fetch", sys.argv[1])
fetch = importlib.util.module_from_spec(spec)
sys.modules["fetch"] = fetch
spec.loader.exec_module(fetch)
wheel, log, cache, sha = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]

def download(requirement, dest):
    with open(log, "a") as f:
        f.write("download\\n")
    time.sleep(0.5)
    return Path(shutil.copy(wheel, dest))

fetch._pip_download = download
print(fetch.fetch_wheel_file(fetch.WheelFile("fakepkg==1.0", "fakepkg/model.bin", sha), cache))
"""


def test_concurrent_processes_download_once(tmp_path, fake_wheel):
    """Two processes (as pytest-xdist workers would) share one cache through the file lock."""
    cache, log = tmp_path / "cache", tmp_path / "downloads.log"
    # engine/fetch.py is loaded as a lone module: the engine package would import torch.
    spec = importlib.util.find_spec("kvbatch.fetch")
    args = [
        sys.executable,
        "-c",
        _CHILD,
        spec.origin,
        str(fake_wheel),
        str(log),
        str(cache),
        ITEM.sha256,
    ]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o.strip() for o in outs] == [str(cache / "model.bin")] * 2
    assert log.read_text() == "download\n"
    assert (cache / "model.bin").read_bytes() == PAYLOAD


def test_pip_failure_says_what_failed(tmp_path):
    with pytest.raises(FetchError, match="(?s)pip download.*Invalid requirement"):
        fetch._pip_download("not a valid requirement!!", tmp_path)


# --- the real SmolLM2 files -------------------------------------------------------------------


def test_smollm2_gguf_is_the_pinned_file(smollm2_gguf):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    h = hashlib.sha256()
    with open(smollm2_gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == fetch.SMOLLM2_GGUF.sha256
    assert fetch.smollm2_gguf(smollm2_gguf.parent) == smollm2_gguf  # cached: no download


def test_smollm2_dir_is_a_complete_hf_folder(smollm2_dir):
    from transformers import AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and tok.eos_token_id == 2


def test_main_prints_the_folder_last(smollm2_dir, capsys):
    fetch.main(["--cache-dir", str(smollm2_dir.parent)])
    assert capsys.readouterr().out.splitlines()[-1] == str(smollm2_dir)
    fetch.main(["--cache-dir", str(smollm2_dir.parent), "--gguf"])
    assert capsys.readouterr().out.strip().endswith(".gguf")


def test_converted_folder_is_readable_by_other_users(tmp_path, smollm2_dir):
    """A container running as another uid reads the cache: every file 0644, including a
    folder converted while safetensors still wrote its weights 0600."""
    old = tmp_path / fetch.SMOLLM2_DIR_NAME
    old.mkdir()
    for name in fetch.HF_DIR_FILES:
        (old / name).write_text("{}")
        (old / name).chmod(0o600)
    assert fetch.smollm2_dir(tmp_path) == old
    assert {oct((old / n).stat().st_mode & 0o777) for n in fetch.HF_DIR_FILES} == {"0o644"}
    for f in fetch.smollm2_dir(smollm2_dir.parent).iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f"{f} is not readable by other users"
