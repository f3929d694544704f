"""scripts/compile_check.py: the engine's kernels compile for an H200 (sm_90) on this machine.

Runs in a subprocess: the check swaps Triton's active driver and its launch path, which must
not leak into the other tests (which run the kernels under the interpreter, or on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every kernel compiled for real: a minute or more

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_write_kv_kernel",
    "_act_and_mul_kernel",  # SiLU- or GELU(tanh)-and-mul
    "_decode_split_kernel",
    "_merge_splits_kernel",
    "_prefill_kernel",
    "_merge_prefill_splits_kernel",  # a mixed step's graph splits keys for the longest context
    "_merge_kernel",
}
# --models moe,gemma,quantized,gpt-oss: the fused MoE kernels (float, W4A16, FP8 and block-FP8
# experts), the quantized GEMMs and their activation quantizers; Gemma's kernels are the
# Llama ones with other constexprs (GELU, (1 + w) norms, head dim 256)
OTHER_PATHS = {
    "_grouped_gemm_kernel",
    "_wna16_grouped_gemm_kernel",
    "_w8a8_grouped_gemm_kernel",
    "_fp8_block_grouped_gemm_kernel",
    "_wna16_gemm_kernel",
    "_scaled_mm_kernel",
    "_quantize_fp8_kernel",
    "_block_scaled_mm_kernel",
    "_quantize_groups_kernel",
    "_mxfp4_grouped_gemm_kernel",  # gpt-oss's MXFP4 experts
}


def test_every_kernel_the_engine_launches_compiles_for_sm90(tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a real compile, not a cache hit
    done = subprocess.run(  # fmt: skip
        [
            sys.executable,
            "scripts/compile_check.py",
            "--dtypes",
            "bfloat16",
            "--json",
            str(out),
            "--models",
            "llama,moe,gemma,quantized,gpt-oss",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["arch"] == 90 and not report["errors"]
    rows = report["kernels"]
    assert {r["kernel"] for r in rows} == KERNELS | OTHER_PATHS
    assert all(r["fits"] and r["dtype"] == "bfloat16" for r in rows)
    assert all(r["registers"] and r["registers"] <= 255 for r in rows)  # ptxas reported them
    attention = [r for r in rows if r["kernel"] in ("_prefill_kernel", "_decode_split_kernel")]
    assert all(r["shared_bytes"] > 0 for r in attention)  # pipelined tiles live in shared memory
    assert "| _prefill_kernel | bfloat16 |" in done.stdout
    # eager steps of varying sizes compile each kernel once per set of constexprs and pointer
    # types, not once per alignment of a step's metadata (kernels/specialize.py)
    specs = {r["kernel"]: r for r in report["specialisations"]}
    assert set(specs) == KERNELS | OTHER_PATHS
    assert all(r["variants"] == r["constexpr_sets"] for r in specs.values())
    assert specs["_prefill_kernel"]["variants"] >= 4  # causal or not, split or not
    assert "variants compiled per kernel" in done.stdout
