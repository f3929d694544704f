"""Hub ids for `--model` and `LLM(model=...)`, against a local stand-in for the Hub
(tests/hub_server.py; HF_ENDPOINT points at it) and huggingface_hub's cache in a tmp HF_HOME.
No test reaches the internet. huggingface_hub reads HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE
when it is imported, so each resolution runs in a fresh interpreter, as a user's command does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.hub import (
    ALLOW_PATTERNS,
    ModelNotFoundError,
    is_hub_id,
    resolve_model,
    split_hub_id,
)
from tests.hub_server import HubServer, hub_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
REPO = "kvbatch-test/tiny-chat"
NOT_NEEDED = {"pytorch_model.bin", "README.md", "onnx/model.onnx"}
_RESOLVE = "import sys; from kvbatch.hub import resolve_model; print(resolve_model(*sys.argv[1:]))"


@pytest.fixture
def hub(hub_server: HubServer, tiny_chat_model: Path, tmp_path: Path) -> HubServer:  # noqa: F811
    """The tiny chat checkpoint on the stand-in Hub, with files the engine never reads."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for f in tiny_chat_model.iterdir():
        if f.is_file():
            (repo / f.name).write_bytes(f.read_bytes())
    (repo / "pytorch_model.bin").write_bytes(b"the same weights in another format")
    (repo / "README.md").write_text("# tiny chat\n")
    (repo / "onnx").mkdir()
    (repo / "onnx" / "model.onnx").write_bytes(b"onnx")
    hub_server.add_folder(REPO, repo, v1="1" * 40)
    return hub_server


def _env(hub: HubServer, home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_") and k not in ("HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
    }
    return {
        **env,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        **extra,
    }


def _resolve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _RESOLVE, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _snapshot(home: Path, repo_id: str, commit: str) -> Path:
    return home / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


def test_hub_id_downloads_only_what_the_engine_reads(hub, tiny_chat_model, tmp_path):
    home = tmp_path / "hf"
    proc = _resolve(_env(hub, home), REPO)
    assert proc.returncode == 0, proc.stderr
    main = hub.repos[REPO].revisions["main"]
    folder = Path(proc.stdout.strip())
    assert folder == _snapshot(home, REPO, main)
    served = set(hub.repos[REPO].files)
    assert hub.fetched(REPO) == served - NOT_NEEDED
    assert {"config.json", "model.safetensors"} <= hub.fetched(REPO)
    for name in served - NOT_NEEDED:
        assert (folder / name).read_bytes() == (tiny_chat_model / name).read_bytes()
    assert not any((folder / name).exists() for name in NOT_NEEDED)


def test_submit_fetches_the_tokenizer_and_a_worker_the_rest(hub, tmp_path):
    env, home = _env(hub, tmp_path / "hf"), tmp_path / "hf"
    script = (
        "import sys; from kvbatch.hub import resolve_model; "
        "print(resolve_model(sys.argv[1], tokenizer_only=True))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, REPO], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "tokenizer.json"} <= hub.fetched(REPO)
    assert "model.safetensors" not in hub.fetched(REPO)
    worker = _resolve(env, REPO)  # the same snapshot, now with the weights
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout == proc.stdout
    assert "model.safetensors" in hub.fetched(REPO)
    assert (
        _snapshot(home, REPO, hub.repos[REPO].revisions["main"]) / "model.safetensors"
    ).is_file()


def test_revision_picks_the_commit_and_a_missing_one_is_named(hub, tmp_path):
    home = tmp_path / "hf"
    proc = _resolve(_env(hub, home), REPO, "v1")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == _snapshot(home, REPO, "1" * 40)
    missing = _resolve(_env(hub, home), REPO, "no-such-tag")
    assert missing.returncode != 0
    assert "ModelNotFoundError" in missing.stderr and "revision no-such-tag" in missing.stderr


def test_private_repo_needs_hf_token(hub, tmp_path):
    hub.repos[REPO].token = "hf_secret"
    home = tmp_path / "hf"
    refused = _resolve(_env(hub, home), REPO)
    assert refused.returncode != 0 and "HF_TOKEN" in refused.stderr
    proc = _resolve(_env(hub, home, HF_TOKEN="hf_secret"), REPO)
    assert proc.returncode == 0, proc.stderr
    assert hub.requests[-1].authorization == "Bearer hf_secret"


def test_offline_mode_uses_the_cache_and_says_what_is_missing(hub, tmp_path):
    home = tmp_path / "hf"
    online = _resolve(_env(hub, home), REPO)
    assert online.returncode == 0, online.stderr
    before = len(hub.requests)
    offline = _resolve(_env(hub, home, HF_HUB_OFFLINE="1"), REPO)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == online.stdout
    assert len(hub.requests) == before, "offline mode reached the Hub"
    uncached = _resolve(_env(hub, home, HF_HUB_OFFLINE="1"), "kvbatch-test/never-fetched")
    assert uncached.returncode != 0 and "HF_HUB_OFFLINE" in uncached.stderr
    assert len(hub.requests) == before


def test_one_gguf_file_of_a_repository(hub_server, tmp_path):  # noqa: F811
    repo = tmp_path / "gguf-repo"
    repo.mkdir()
    (repo / "model-q8_0.gguf").write_bytes(b"GGUF q8")
    (repo / "model-f16.gguf").write_bytes(b"GGUF f16")
    hub_server.add_folder("kvbatch-test/tiny-gguf", repo)
    proc = _resolve(_env(hub_server, tmp_path / "hf"), "kvbatch-test/tiny-gguf/model-q8_0.gguf")
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name == "model-q8_0.gguf" and path.read_bytes() == b"GGUF q8"
    assert hub_server.fetched("kvbatch-test/tiny-gguf") == {"model-q8_0.gguf"}
    whole = _resolve(_env(hub_server, tmp_path / "hf"), "kvbatch-test/tiny-gguf")
    assert whole.returncode != 0 and "kvbatch-test/tiny-gguf/FILE.gguf" in whole.stderr


def test_workers_on_one_machine_download_once(hub, tmp_path):
    env = _env(hub, tmp_path / "hf")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESOLVE, REPO],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert len({out for out, _ in outs}) == 1
    gets = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert len(gets) == len(set(gets)), "a file was downloaded twice"


@pytest.mark.slow
def test_generate_from_a_hub_id_answers_as_from_the_folder(hub, tiny_chat_model, tmp_path):
    env = _env(hub, tmp_path / "hf")
    answers = []
    for model in (str(tiny_chat_model), REPO):
        proc = subprocess.run(
            [sys.executable, "-m", "kvbatch.cli", "generate", "--model", model, "--threads", "1",
             "--prompt", "The capital of France is", "--max-tokens", "6"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        answers.append(proc.stdout.split(">>> The capital of France is")[1].split("\n\n")[0])
    assert answers[0] == answers[1] and answers[0].strip()


# --- no Hub needed ---------------------------------------------------------------------------


def test_local_path_is_used_as_it_is(tiny_chat_model):
    assert resolve_model(tiny_chat_model) == str(tiny_chat_model)
    with pytest.raises(ModelNotFoundError, match="--revision"):
        resolve_model(tiny_chat_model, revision="main")


@pytest.mark.parametrize(
    "text",
    ["./models/missing", "/no/such/folder", "~/missing", "missing.gguf", "a/b/c", "bad--id/x",
     "owner/name/notes.txt", "-x/y"],
)  # fmt: skip
def test_neither_a_path_nor_a_hub_id_is_a_clear_error(text):
    with pytest.raises(ModelNotFoundError, match="does not exist.*Hub id") as info:
        split_hub_id(text)
    assert repr(text) in str(info.value)


def test_hub_ids_split_into_repository_and_file():
    assert split_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert split_hub_id("owner/name/sub/model.Q8_0.gguf") == ("owner/name", "sub/model.Q8_0.gguf")
    assert "*.safetensors" in ALLOW_PATTERNS and "*.bin" not in ALLOW_PATTERNS


def test_is_hub_id_only_for_what_is_not_a_path(tiny_chat_model, tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_hub_id("owner/name/model.gguf")
    assert not is_hub_id(tiny_chat_model)  # exists
    assert not is_hub_id(tmp_path / "missing")  # an absolute path that is not there
    assert not is_hub_id("./models/missing")


@pytest.mark.slow
def test_llm_takes_a_hub_id_and_a_revision(hub, tmp_path):
    script = (
        "import sys; from kvbatch.engine import LLM; "
        "llm = LLM(model=sys.argv[1], revision=sys.argv[2], device='cpu', kv_cache_bytes=8 << 20); "
        "print(llm.engine.config.model)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, REPO, "v1"],
        cwd=ROOT,
        env=_env(hub, tmp_path / "hf"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == _snapshot(tmp_path / "hf", REPO, "1" * 40)
