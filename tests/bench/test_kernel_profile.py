"""The kernel profile: torch.profiler's events summed by kernel, kind and step kind."""

from __future__ import annotations

import pytest

from kvbatch.bench.kernel_profile import (
    ANNOTATION,
    Record,
    format_kernel_profile,
    kernel_kind,
    profile_engine_run,
    summarize,
)
from kvbatch.bench.models import TINY_LLAMA, random_model_dir
from kvbatch.bench.step_profile import StepProfile
from kvbatch.engine import LLM, SamplingParams


def test_kernel_kinds_from_our_kernels_and_cublas_names():
    assert kernel_kind("_prefill_kernel") == "attention (prefill)"
    assert kernel_kind("_decode_split_kernel") == "attention (decode)"
    assert kernel_kind("_merge_kernel") == "attention (decode)"
    assert kernel_kind("_rms_norm_kernel") == "norm, rotary, act, kv write"
    assert kernel_kind("_write_kv_kernel") == "norm, rotary, act, kv write"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN") == "gemm"
    assert kernel_kind("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_kind("aten::addmm") == "gemm"
    assert kernel_kind("void at::native::reduce_kernel<512, 1>") == "other"


def test_summarize_gpu_records_kernels_and_step_spans():
    """On a GPU: kernels by device time; CPU operators are not counted (their kernels are);
    a step's host time is its CPU-side annotation, its device time the GPU-side one."""
    records = [
        Record(ANNOTATION + "decode", False, 100.0, 2000.0),  # host side of two decode steps
        Record(ANNOTATION + "decode", False, 100.0, 1000.0),
        Record(ANNOTATION + "decode", True, 3000.0, 3000.0),  # their kernels' spans
        Record(ANNOTATION + "decode", True, 5000.0, 5000.0),
        Record(ANNOTATION + "prefill", False, 50.0, 4000.0),  # no GPU-side span recorded
        Record("aten::mm", False, 900.0, 900.0),  # a CPU operator: not device time
        Record("nvjet_tst_gemm", True, 2500.0, 2500.0),
        Record("nvjet_tst_gemm", True, 1500.0, 1500.0),
        Record("_decode_split_kernel", True, 3000.0, 3000.0),
        Record("_rms_norm_kernel", True, 1000.0, 1000.0),
    ]
    p = summarize(records, "cuda", profiled_seconds=0.05, reference_seconds=0.016, top=2)
    assert p.device == "cuda"
    assert p.busy_seconds == pytest.approx(0.008)
    assert p.busy_fraction == pytest.approx(0.5)  # of the unprofiled run
    assert [(r.name, r.calls) for r in p.top] == [
        ("nvjet_tst_gemm", 2),
        ("_decode_split_kernel", 1),
    ]
    assert p.top[0].seconds == pytest.approx(0.004) and p.top[0].share == pytest.approx(0.5)
    assert p.by_kind == pytest.approx(
        {"gemm": 0.004, "attention (decode)": 0.003, "norm, rotary, act, kv write": 0.001}
    )
    assert list(p.by_kind) == ["gemm", "attention (decode)", "norm, rotary, act, kv write"]
    decode, prefill = p.steps["decode"], p.steps["prefill"]
    assert decode.steps == 2 and decode.host_ms_per_step == pytest.approx(1.5)
    assert decode.device_ms_per_step == pytest.approx(4.0)
    assert prefill.steps == 1 and prefill.device_ms_per_step is None
    text = format_kernel_profile(p.to_dict())
    assert "50% of the unprofiled run's 0.02 s" in text
    assert (
        "decode 2 (host 1.50 ms, GPU span 4.00 ms)" in text and "prefill 1 (host 4.00 ms)" in text
    )
    assert "nvjet_tst_gemm" in text and "aten::mm" not in text


def test_summarize_cpu_records_rank_operators_by_self_time():
    records = [
        Record("aten::linear", False, 10.0, 510.0),
        Record("aten::addmm", False, 500.0, 500.0),
        Record("aten::softmax", False, 90.0, 90.0),
    ]
    p = summarize(records, "cpu", profiled_seconds=0.001)
    assert [r.name for r in p.top] == ["aten::addmm", "aten::softmax", "aten::linear"]
    assert p.busy_seconds == pytest.approx(600e-6)
    assert p.busy_fraction == pytest.approx(0.6)  # of the profiled run when nothing else ran
    assert p.steps == {}


def test_profile_a_real_run_on_the_cpu(tmp_path):
    """One run of the engine under the profiler: every step annotated with its kind, the
    runner's (already wrapped) launch given back afterwards."""
    llm = LLM(str(random_model_dir(TINY_LLAMA, tmp_path)), max_num_batched_tokens=32)
    engine = llm.engine
    StepProfile(engine)  # as in the benchmark: launch is already a wrapper
    wrapped = engine.runner.launch
    steps_before = engine._num_steps
    prompts = [[5 + i] * 40 for i in range(3)]  # 120 prompt tokens: 4+ steps of 32
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    p = profile_engine_run(engine, lambda: llm.generate(prompts, params, use_tqdm=False))
    assert engine.runner.launch is wrapped
    assert p.device == "cpu" and 0 < p.busy_seconds <= p.profiled_seconds
    assert sum(s.steps for s in p.steps.values()) == engine._num_steps - steps_before
    kinds = {k: s.steps for k, s in p.steps.items()}
    assert kinds["prefill"] >= 2 and kinds["mixed"] >= 1 and kinds["decode"] >= 2, kinds
    assert all(s.device_ms_per_step is None and s.host_ms_per_step > 0 for s in p.steps.values())
    assert p.top and all(not r.name.startswith(ANNOTATION) for r in p.top)
    seconds = [r.seconds for r in p.top]
    assert seconds == sorted(seconds, reverse=True)
    assert "gemm" in p.by_kind  # the linear layers
