"""The model fingerprint a job records and a worker compares (kvbatch/jobs/model_fingerprint.py),
on real checkpoints saved by transformers and GGUF files written by the gguf package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.jobs.model_fingerprint import (
    SAMPLE_BYTES,
    SAMPLES,
    FingerprintError,
    ModelFingerprint,
    describe_mismatch,
    fingerprint,
)
from tests.hub_server import hub_server  # noqa: F401
from tests.kvbatch.test_hub import hub  # noqa: F401
from tests.tiny_models import build_tiny_chat_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, smollm2_dir: Path) -> Path:
    """The tiny chat model of seed 1: same config and tokenizer as tiny_chat_model, other
    weights (the case where only sampled weight bytes tell them apart)."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("seed1") / "model", smollm2_dir, 1)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_copy_elsewhere_matches_and_formatting_does_not_count(tmp_path, tiny_chat_model):
    copy = _copy(tiny_chat_model, tmp_path / "elsewhere" / "renamed")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=7))
    original, copied = fingerprint(tiny_chat_model), fingerprint(copy)
    assert copied == original
    assert set(original.parts) == {"config", "tokenizer", "weights", "quantization"}
    assert original.parts["quantization"] == "none"
    assert describe_mismatch(original, copied) is None
    assert ModelFingerprint.from_dict(original.to_dict()) == original


def test_other_weights_of_the_same_shape_differ(tiny_chat_model, other_weights):
    job, worker = fingerprint(tiny_chat_model), fingerprint(other_weights)
    assert (tiny_chat_model / "model.safetensors").stat().st_size == (
        other_weights / "model.safetensors"
    ).stat().st_size
    assert (tiny_chat_model / "model.safetensors").stat().st_size > SAMPLES * SAMPLE_BYTES
    assert job.differences(worker) == ["weights"]
    reason = describe_mismatch(job, worker)
    assert reason is not None and "its weights differ" in reason
    assert job.digest in reason and worker.digest in reason


def test_an_unchanged_weight_file_is_not_read_again(tmp_path, tiny_chat_model, other_weights):
    """A weight file's digest is remembered by (path, size, mtime): bytes replaced under the
    same size and mtime go unseen (nothing was read), a rewrite with a new mtime is read."""
    model = _copy(tiny_chat_model, tmp_path / "model")
    weights = model / "model.safetensors"
    first = fingerprint(model)
    stat = weights.stat()
    shutil.copyfile(other_weights / "model.safetensors", weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(model) == first  # the remembered digest: the file was not read
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint(model).differences(first) == ["weights"]  # read again: new weights


def test_tokenizer_config_and_quantization_each_count(tmp_path, tiny_chat_model):
    base = fingerprint(tiny_chat_model)
    template = _copy(tiny_chat_model, tmp_path / "template")
    (template / "chat_template.jinja").write_text("{{ messages }}")
    assert base.differences(fingerprint(template)) == ["tokenizer"]

    pooled = _copy(tiny_chat_model, tmp_path / "pooled")
    (pooled / "1_Pooling").mkdir()
    (pooled / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert base.differences(fingerprint(pooled)) == ["config"]

    quantized = _copy(tiny_chat_model, tmp_path / "quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
    }  # noqa: E501
    (quantized / "config.json").write_text(json.dumps(config))
    other = fingerprint(quantized)
    assert other.parts["quantization"] == "compressed-tensors:float-quantized"
    assert base.differences(other) == ["config", "quantization"]
    assert "quantization (none here, compressed-tensors:float-quantized on this worker)" in (
        describe_mismatch(base, other) or ""
    )


def test_a_hub_snapshot_without_weights_compares_what_it_has(
    tmp_path, tiny_chat_model, other_weights
):  # noqa: E501
    """`kvbatch submit` of a Hub id reads a snapshot of the config and tokenizer only: its
    fingerprint has no weights, and a revision; a worker's local copy has weights and no
    revision. The parts both have decide."""
    snapshot = tmp_path / "hub" / "models--o--n" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for p in tiny_chat_model.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, snapshot / p.name)
    job = fingerprint(snapshot)
    assert job.parts["revision"] == COMMIT and "weights" not in job.parts
    assert describe_mismatch(job, fingerprint(tiny_chat_model)) is None
    assert describe_mismatch(job, fingerprint(other_weights)) is None  # weights not compared
    other_commit = tmp_path / "hub" / "models--o--n" / "snapshots" / ("f" * 40)
    _copy(snapshot, other_commit)
    assert job.differences(fingerprint(other_commit)) == ["revision"]


def test_gguf_files(tmp_path):
    from tests.tiny_gguf import build_tiny_gguf

    hf, gguf = build_tiny_gguf("qwen3", tmp_path / "a")
    _, other = build_tiny_gguf("qwen3", tmp_path / "b", seed=1)
    copy = tmp_path / "c" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    assert fingerprint(copy) == fingerprint(gguf)
    assert set(fingerprint(gguf).parts) == {"weights"}
    assert fingerprint(gguf).differences(fingerprint(other)) == ["weights"]
    assert "its weights differ" in (describe_mismatch(fingerprint(hf), fingerprint(gguf)) or "")
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    shutil.copy(hf / "config.json", tokenizer_only / "config.json")
    reason = describe_mismatch(fingerprint(tokenizer_only), fingerprint(gguf))
    assert reason is not None and "has nothing to compare with the job's" in reason


def test_what_cannot_be_fingerprinted_is_named(tmp_path, tiny_chat_model):
    broken = _copy(tiny_chat_model, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(FingerprintError, match=f"{broken / 'config.json'}: cannot read it"):
        fingerprint(broken)
    with pytest.raises(FingerprintError, match="neither a checkpoint folder nor a .gguf"):
        fingerprint(tmp_path / "absent")
    with pytest.raises(FingerprintError, match="must be an object"):
        ModelFingerprint.from_dict(["config"])


def test_a_hub_id_submitted_and_fetched_by_a_worker(hub, tiny_chat_model, tmp_path):  # noqa: F811
    """Through huggingface_hub's own cache (the stand-in Hub): the submit's tokenizer-only
    snapshot and a worker's full one of the same commit match; another commit does not."""
    from tests.kvbatch.test_hub import REPO, _env, _resolve

    env = _env(hub, tmp_path / "hf")
    script = "import sys; from kvbatch.hub import resolve_model; print(resolve_model(sys.argv[1], tokenizer_only=True))"  # noqa: E501
    proc = subprocess.run(
        [sys.executable, "-c", script, REPO], env=env, capture_output=True, text=True, timeout=120
    )  # noqa: E501
    assert proc.returncode == 0, proc.stderr
    job = fingerprint(proc.stdout.strip())  # what `kvbatch submit` records
    assert job.parts["revision"] == hub.repos[REPO].revisions["main"]
    assert "weights" not in job.parts
    worker = _resolve(env, REPO)  # the worker's LLM(model=REPO): the same snapshot, weights too
    assert worker.returncode == 0, worker.stderr
    full = fingerprint(worker.stdout.strip())
    assert describe_mismatch(job, full) is None
    assert full.parts["weights"] == fingerprint(tiny_chat_model).parts["weights"]  # via symlinks
    older = _resolve(env, REPO, "v1")
    assert older.returncode == 0, older.stderr
    assert job.differences(fingerprint(older.stdout.strip())) == ["revision"]
