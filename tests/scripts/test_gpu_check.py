"""scripts/gpu-check.sh's steps import only what the H200 image has (scripts/h200_image).

The device machine has no network and 15 minutes a session: a GPU path that started importing
pydantic or boto3 would fail there after the machine's start was paid for. These run the
check's commands here with kvbatch's dependencies that the image lacks hidden.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "scripts" / "h200_image"


def run_as_image(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(IMAGE), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_steps(
    out: Path, only: str, timeout: float = 300, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    """scripts/gpu-check.sh --cpu --only `only` into `out`: the process (it must succeed) and
    steps.tsv's rows by step."""
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--cpu", "--only", only, "--out", str(out)],
        cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with (out / "steps.tsv").open() as f:
        rows = {row[0]: row for row in (line.rstrip("\n").split("\t") for line in f)}
    return r, rows


def test_the_image_hides_the_packages_it_lacks():
    r = run_as_image(
        "-c",
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('boto3') is None\n"
        "import kvbatch.engine, kvbatch.kernels, transformers\n"
        "assert 'pydantic' not in sys.modules\n"
        "import kvbatch.jobs.openai_format.schemas\n",  # jobs/ needs pydantic: this must fail
        timeout=120,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    assert "No module named 'pydantic'" in r.stderr, r.stderr


@pytest.mark.slow
def test_the_gpu_tests_collect_without_them():
    r = run_as_image(
        "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
        "-o", "pythonpath=", "--import-mode=append",  # as gpu-check.sh runs them
        "tests/kernels", "tests/engine/attention/test_triton_backend.py",
        "tests/engine/attention/test_fp8_kv_cache.py", "tests/engine/exec/test_cuda_graphs.py",
        "tests/engine/quant/test_gemm_kernels.py",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # collection errors: "ERROR collecting ..." lines and "N errors" in the last line (not
    # the test names, some of which are about errors)
    last = r.stdout.strip().splitlines()[-1]
    assert "ERROR" not in r.stdout and "error" not in last, r.stdout[-3000:]


@pytest.mark.slow
def test_the_greedy_check_runs_without_them():
    """(The benchmark runs without them in the script's own test below: --cpu hides them.)"""
    greedy = run_as_image(
        "scripts/greedy_check.py", "--device", "cpu", "--backend", "torch", "--models", "tiny",
        timeout=300,
    )  # fmt: skip
    assert greedy.returncode == 0, greedy.stdout[-3000:] + greedy.stderr[-3000:]
    assert "greedy check PASS: tiny ok (logprobs within" in greedy.stdout


@pytest.mark.slow
def test_the_script_runs_a_chosen_step_and_sums_it_up(tmp_path: Path):
    """scripts/gpu-check.sh itself, on the CPU with --only: steps, limits, results, summary;
    rag-qwen3 (the dense Qwen3 against transformers) among the chosen steps."""
    out = tmp_path / "out"
    _, steps = run_steps(out, "rag,prefill-*,rag-hf-cb,rag-qwen3")
    status = {step: row[1] for step, row in steps.items()}
    assert status.pop("step") == "status"  # the header
    quant = {k: status.pop(k) for k in list(status) if k.startswith("quant-")}
    assert quant.pop("quant-gemm") == "skipped"
    assert quant and set(quant.values()) == {"skipped"}  # quant-greedy and every row
    assert status.pop("moe-greedy") == status.pop("rag-moe") == "skipped"
    assert status == {
        "versions": "ok",
        "kernels": "skipped",
        "prefill-splits": "ok",
        "triton-test": "skipped",
        "greedy": "skipped",
        "rag": "ok",
        "long-prefill": "skipped",
        "rag-gemma": "skipped",
        "long-prefill-eager": "skipped",
        "long-prefill-gc": "skipped",  # and no token cap's step: LONG_PREFILL_CAPS is empty
        "rag-hf-cb": "ok",
        "rag-qwen3": "ok",
        "rag-gpt-oss": "skipped",
        "rag-sweep": "skipped",
        "embed-gpu": "skipped",
        "rag-hybrid": "skipped",
        "rag-mla": "skipped",
        "index-gpu": "skipped",
        "summary": "ok",
    }
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.log", "qwen3-rag.json", "rag-hf-cb.json", "rag.json", "steps.tsv",
        "summary.txt",
    ]  # fmt: skip
    result = json.loads((out / "rag.json").read_text())  # the bench, with the image's packages
    assert result["workload"]["name"] == "rag-tiny"
    assert {e["engine"] for e in result["engines"]} >= {"kvbatch", "hf-static", "kvbatch-sync"}
    assert result["engines"][0]["extra"]["kernel_profile"]["top"]  # the profiler ran there too
    summary = (out / "summary.txt").read_text()
    assert "rag-tiny on cpu" in summary and "kvbatch kernel profile" in summary
    assert "long-prefill: skipped" in summary  # not "failed": --only left it out
    assert "rag with hf-cb (its own step):" in summary  # transformers' continuous batching
    assert "greedy tokens hf-cb vs kvbatch: 4/4" in summary
    qwen3 = summary.split("rag-qwen3 (its own step):")[1]  # with the image's packages too
    assert "rag-qwen3-tiny on cpu" in qwen3
    assert "greedy tokens hf-static vs kvbatch: 4/4" in qwen3  # the dense Qwen3's tokens
    bad = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


@pytest.mark.slow
def test_the_gemma_window_step_runs_both_modes_and_is_summed_up(tmp_path: Path):
    """rag-gemma at its tiny size (--cpu), with the H200 image's packages only: both modes,
    their greedy tokens equal, the verdict in the steps table and the summary's table."""
    out = tmp_path / "out"
    _, rows = run_steps(out, "rag-gemma", VERSIONS_TIMEOUT="120")
    assert rows["rag-gemma"][1] == "ok"
    assert rows["rag-gemma"][5].endswith("; greedy tokens identical")
    result = json.loads((out / "gemma-window.json").read_text())
    assert result["model"]["name"] == "gemma3-tiny" and set(result["modes"]) == {"on", "off"}
    summary = (out / "summary.txt").read_text()
    assert "gemma-window: gemma3-tiny (window 32) on cpu" in summary


@pytest.mark.slow
def test_the_hybrid_and_mla_steps_run_at_their_tiny_size(tmp_path: Path):
    """rag-hybrid (--cpu: the tiny Qwen3.5 shape) and rag-mla (the tiny DeepSeek-V3 shape)
    with the H200 image's packages only: kvbatch's greedy tokens equal transformers', and the
    JSON names the size and dtype."""
    out = tmp_path / "out"
    _, rows = run_steps(out, "rag-hybrid,rag-mla", VERSIONS_TIMEOUT="120")
    assert rows["rag-hybrid"][1] == rows["rag-mla"][1] == "ok", rows
    result = json.loads((out / "rag-hybrid.json").read_text())
    assert result["same_tokens"] and (result["size"], result["dtype"]) == ("tiny", "float32")
    per_gib = result["sequences_per_gib"]
    assert per_gib["hybrid"] > per_gib["full_attention"]
    mla = json.loads((out / "rag-mla.json").read_text())
    assert mla["same_tokens"] and (mla["size"], mla["dtype"]) == ("tiny", "float32")
    kv = mla["kv_bytes_per_token"]
    assert kv["engine"] == kv["mla"] < kv["gqa"]


def test_the_index_step_is_skipped_with_what_the_image_lacks(tmp_path: Path):
    """index-gpu needs lancedb, sentence-transformers, semchunk and gguf: the H200 image (as
    --cpu imitates it) has none of them, so the step is skipped with a line naming them, and
    the check does not fail for it."""
    out = tmp_path / "out"
    _, rows = run_steps(out, "index-gpu", VERSIONS_TIMEOUT="120")
    assert rows["index-gpu"][1] == "skipped"
    assert rows["index-gpu"][5].startswith("needs lancedb sentence_transformers semchunk gguf")
    assert not (out / "index-gpu.json").exists()


@pytest.mark.slow
def test_the_quantized_and_moe_steps_run_and_are_summed_up(tmp_path: Path):
    """quant-greedy (the kernels against the reference path, interpreted), three benchmark
    rows (one with 4-bit experts in the fused MoE kernel),
    moe-greedy and rag-moe, with the H200 image's packages only; the summary's table gives the
    FP8 row's speed against the float row and each row's weights and KV capacity."""
    out = tmp_path / "out"
    only = "quant-greedy,quant-no-*,quant-moe-*,moe-greedy,rag-moe"
    rows = "no-share-bf16 no-share-fp8-kv moe-w4a16 no-such-row"
    _, steps = run_steps(out, only, timeout=600, QUANT_ROWS=rows)
    status = {step: row[1] for step, row in steps.items()}
    assert status["quant-greedy"] == "ok"
    assert status["quant-no-share-bf16"] == status["quant-no-share-fp8-kv"] == "ok"
    assert status["quant-moe-w4a16"] == "ok"  # 4-bit experts in the fused MoE kernel
    assert status["quant-no-such-row"] == "skipped"
    assert status["moe-greedy"] == status["rag-moe"] == "ok"
    summary = (out / "summary.txt").read_text()
    assert "rag-moe (its own step):" in summary and "rag-moe-tiny on cpu" in summary
    assert "greedy tokens hf-static vs kvbatch: 4/4" in summary  # the MoE against transformers
    assert "quantized rows" in summary
    fp8_row = next(line for line in summary.splitlines() if line.startswith("no-share-fp8-kv"))
    assert " fp8 " in fp8_row and "float8_e4m3fn" in fp8_row
    moe_row = next(line for line in summary.splitlines() if line.startswith("moe-w4a16")).split()
    assert moe_row[3] == "gptq" and moe_row[7] != "-"  # against the rag-moe step's float row
    float_row = next(line for line in summary.splitlines() if line.startswith("no-share-bf16"))
    assert " 1.00 " in float_row  # the float row is the baseline of its workload
