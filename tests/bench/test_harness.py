"""The side-by-side harness on a tiny random Llama: the table, the JSON, the CLI and kvbatch.

The kvbatch end-to-end tests skip themselves while `engine.LLM` cannot be imported.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvbatch.bench import cli
from kvbatch.bench.harness import (
    BenchConfig,
    BenchError,
    engine_order,
    floor_applies,
    percentiles,
    run_benchmark,
)
from kvbatch.bench.hf_peers import HFStaticPeer
from kvbatch.bench.peers import (
    PEERS,
    EngineOptions,
    KvbatchPeer,
    PeerUnavailable,
    make_peer,
)
from kvbatch.bench.workloads import WORKLOADS
from tests.bench.tiny_llama import TINY
from tests.scripts import load_script


@pytest.fixture
def tiny_registered(monkeypatch):
    monkeypatch.setitem(WORKLOADS, TINY.name, TINY)
    return TINY


def test_registry_and_options():
    assert {"kvbatch", "hf-static"} <= set(PEERS)
    with pytest.raises(ValueError, match="hf-static"):
        make_peer("nope", "x", EngineOptions())
    with pytest.raises(ValueError, match="dtype"):
        EngineOptions(dtype="int8")
    assert engine_order(["hf-static", "kvbatch", "hf-static"]) == ("kvbatch", "hf-static")
    assert engine_order(["hf-static"], include_kvbatch=False) == ("hf-static",)
    with pytest.raises(BenchError):
        BenchConfig(workload=TINY, model_path="x", engines=())


# --- harness and CLI -----------------------------------------------------------------------

EXPECTED_KEYS = {
    "kind",
    "floor",
    "workload",
    "model_path",
    "options",
    "repeat",
    "reference",
    "engines",
    "prefix_hit_rate",
    "cached_token_fraction",
    "greedy_match",
    "warnings",
    "machine",
    "date",
    "command",
}
MACHINE_KEYS = {"cpu_count", "torch_threads", "torch", "transformers", "device", "device_name"}


def _check_engine_rows(data: dict, engines: list[str], repeat: int) -> None:
    assert [e["engine"] for e in data["engines"]] == engines
    for e in data["engines"]:
        assert e["seconds"] > 0 and e["tokens_per_s"] > 0
        assert e["output_tokens"] == TINY.output_tokens == 16
        assert len(e["seconds_all"]) == repeat
        assert e["ratio"] > 0
    assert data["engines"][0]["ratio"] == pytest.approx(1.0)


def test_run_benchmark_with_hf_static_only(tiny_model):
    config = BenchConfig(
        workload=TINY,
        model_path=str(tiny_model),
        engines=("hf-static",),
        repeat=2,
        threads=1,
        command="test",
    )
    report = run_benchmark(config)
    assert torch.get_num_threads() == 1
    data = json.loads(json.dumps(report.to_dict()))
    assert EXPECTED_KEYS <= set(data)
    assert MACHINE_KEYS <= set(data["machine"])
    _check_engine_rows(data, ["hf-static"], repeat=2)
    assert data["prefix_hit_rate"] is None and data["greedy_match"] == []
    assert data["warnings"] == []
    table = report.format_table()
    assert "hf-static" in table and "tiny: 4 requests" in table and "1.00" in table


def test_cli_peers_only_writes_json(tiny_model, tiny_registered, tmp_path, capsys):
    out = tmp_path / "sub" / "bench.json"
    argv = ["tiny", "--skip-kvbatch", "--peers", "hf-static", "--model", str(tiny_model)]
    argv += ["--json", str(out), "--threads", "1", "--hf-batch-size", "2"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "hf-static" in printed
    data = json.loads(out.read_text())
    assert EXPECTED_KEYS <= set(data)
    assert data["command"].startswith("kvbatch bench tiny --skip-kvbatch")
    assert data["options"]["hf_batch_size"] == 2
    assert data["workload"]["prompt_len"] == 52
    _check_engine_rows(data, ["hf-static"], repeat=1)


def test_cli_user_errors_exit_2(tiny_model, tiny_registered, capsys):
    assert cli.main(["tiny", "--model", str(tiny_model), "--peers", "nope"]) == 2
    assert "unknown peer nope" in capsys.readouterr().err
    assert cli.main(["tiny", "--model", str(tiny_model), "--skip-kvbatch"]) == 2
    assert cli.main(["tiny", "--model", "/does/not/exist"]) == 2
    assert cli.main(["nope"]) == 2
    assert cli.main(["--list"]) == 0
    assert "rag-cpu" in capsys.readouterr().out


def test_model_without_fetcher_needs_model_flag(tiny_registered, capsys):
    assert cli.main(["tiny"]) == 2
    assert "--model" in capsys.readouterr().err


# --- kvbatch end to end (once the engine exists) -------------------------------------------


def test_cli_kvbatch_and_hf_static_end_to_end(tiny_model, tiny_registered, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["tiny", "--peers", "hf-static", "--model", str(tiny_model), "--json", str(out)]
    argv += ["--threads", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "kvbatch" in printed and "hf-static" in printed and "prefix cache" in printed
    data = json.loads(out.read_text())
    assert EXPECTED_KEYS <= set(data)
    _check_engine_rows(data, ["kvbatch", "hf-static"], repeat=1)
    assert data["reference"] == "kvbatch"
    assert data["options"]["max_num_seqs"] == 8
    kv = data["engines"][0]["extra"]
    assert kv["prompt_tokens"] == TINY.num_requests * TINY.prompt_len
    assert 0.0 <= kv["cached_token_fraction"] <= 1.0
    assert data["prefix_hit_rate"] is None or 0.0 <= data["prefix_hit_rate"] <= 1.0
    (match,) = data["greedy_match"]
    assert match["engine"] == "hf-static" and match["compared"] == 4
    # float32 on a tiny model: kvbatch is expected to decode hf's greedy tokens exactly
    assert match["matching"] == 4


def test_kvbatch_prefix_cache_accounting(tiny_model):
    """One request at a time: each document's 2 full blocks (32 of its 40 tokens) are cached
    by its first chunk and hit by its 2 later chunks; nothing hits with caching off."""
    w = dataclasses.replace(TINY, chunks_per_document=3)
    options = EngineOptions(max_num_seqs=1)
    config = BenchConfig(
        workload=w, model_path=str(tiny_model), engines=("kvbatch",), options=options
    )
    report = run_benchmark(config)
    extra = report.summary("kvbatch").extra
    assert extra["prompt_tokens"] == 6 * 52
    assert extra["cached_prompt_tokens"] == 2 * 2 * 32
    assert report.cached_token_fraction == pytest.approx(128 / 312)
    no_cache = dataclasses.replace(
        config, options=dataclasses.replace(options, enable_prefix_caching=False)
    )
    assert run_benchmark(no_cache).summary("kvbatch").extra["cached_prompt_tokens"] == 0


# --- latency, floor, long-prefill, unavailable peers (issue 5) -----------------------------

LATENCY_KEYS = {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "floor_fraction", "long_prefill"}


@pytest.mark.slow
def test_cli_rag_tiny_with_hf_static_end_to_end(random_cache, tmp_path, capsys):
    """`kvbatch bench rag --tiny --peers hf-static,kvbatch-sync`: the GPU check's path."""
    from kvbatch.cli import main as kvbatch_main

    out = tmp_path / "rag.json"
    argv = ["bench", "rag", "--tiny", "--peers", "hf-static,kvbatch-sync", "--json", str(out)]
    assert kvbatch_main(argv + ["--threads", "1", "--kernel-profile"]) == 0
    printed = capsys.readouterr().out
    for head in ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ratio", "greedy match"):
        assert head in printed
    assert "of floor" not in printed  # the floor is an H200 figure
    data = json.loads(out.read_text())
    assert data["kind"] == "bench" and data["workload"]["name"] == "rag-tiny"
    assert str(random_cache) in data["model_path"]
    assert data["options"]["hf_batch_size"] == 8  # the workload's static batch size
    assert data["floor"] == {"seconds": None, "device": "H200", "applies": False}
    kv, hf, sync = data["engines"]
    assert (kv["engine"], hf["engine"], sync["engine"]) == ("kvbatch", "hf-static", "kvbatch-sync")
    for e in (kv, hf, sync):
        assert LATENCY_KEYS <= set(e)
        assert e["output_tokens"] == 16 * 8
        assert 0 < e["ttft_p50"] <= e["ttft_p99"] <= e["seconds"]
        assert 0 < e["tpot_p50"] <= e["tpot_p99"] < e["seconds"]
        assert e["floor_fraction"] is None and e["long_prefill"] is None
    assert kv["ratio"] == pytest.approx(1.0)
    assert hf["ratio"] == pytest.approx(hf["seconds"] / kv["seconds"])
    # float32 on the CPU: the same tokens
    assert [g["matching"] for g in data["greedy_match"]] == [4, 4]
    assert kv["extra"]["cached_prompt_tokens"] > 0  # documents are shared
    profile = kv["extra"]["step_profile"]  # where the steps' time went (last run)
    assert profile["steps"] >= 8 and profile["host_seconds"] < kv["seconds"]  # 8 output tokens
    kernels = kv["extra"]["kernel_profile"]  # --kernel-profile: one more run, profiled
    assert kernels["device"] == "cpu" and kernels["reference_seconds"] == kv["seconds"]
    assert kernels["steps"]["decode"]["steps"] >= 7 and kernels["top"]
    assert "kernel_profile" not in sync["extra"]  # kvbatch alone is profiled
    assert "kvbatch kernel profile (one more run under torch.profiler, cpu" in printed

    # scripts/gpu_check_summary.py reads this JSON into the GPU check's closing table
    (tmp_path / "steps.tsv").write_text(
        "step\tstatus\trc\tseconds\tlimit\tlast line\nrag\tok\t0\t9\t180\twrote rag.json\n"
    )
    data["warnings"] = ["hf-cb is unavailable and was skipped: no generate_batch"]
    out.write_text(json.dumps(data))
    text = load_script("gpu_check_summary").summary(tmp_path)
    assert "greedy tokens hf-static vs kvbatch: 4/4\n" in text  # float32: no caveat
    data["options"]["dtype"] = "bfloat16"  # as on the GPU, where a near tie may flip a token
    data["greedy_match"][0]["matching"] = 3
    (tmp_path / "rag.json").write_text(json.dumps(data))
    assert "hf-static vs kvbatch: 3/4 (bfloat16 on both" in load_script(
        "gpu_check_summary"
    ).summary(tmp_path)
    data["greedy_match"][0]["matching"] = 4
    out.write_text(json.dumps(data))
    text = load_script("gpu_check_summary").summary(tmp_path)
    assert "warning: hf-cb is unavailable and was skipped: no generate_batch" in text
    assert "rag-tiny on cpu" in text and "hf-static" in text and "ok" in text
    assert "n/a here (not the full rag on an H200)" in text
    assert "kvbatch steps (last run)" in text and "kvbatch-sync steps (last run)" in text
    assert "kvbatch kernel profile" in text
    assert "long-prefill: no results" in text


class _Unavailable(HFStaticPeer):
    name = "test-unavailable"

    def load(self) -> None:
        raise PeerUnavailable("not in this transformers")


def test_an_unavailable_peer_is_skipped_with_a_warning(tiny_model, monkeypatch):
    monkeypatch.setitem(PEERS, _Unavailable.name, _Unavailable)
    config = BenchConfig(
        workload=TINY, model_path=str(tiny_model), engines=("hf-static", _Unavailable.name)
    )
    report = run_benchmark(config)
    assert [s.engine for s in report.engines] == ["hf-static"]
    assert "test-unavailable is unavailable" in report.warnings[0]
    assert "warning: test-unavailable" in report.format_table()
    with pytest.raises(BenchError, match="no engine could run"):
        run_benchmark(dataclasses.replace(config, engines=(_Unavailable.name,)))


def test_floor_shows_only_on_its_device():
    rag = WORKLOADS["rag"]
    h200 = {"device": "cuda", "device_name": "NVIDIA H200"}
    assert floor_applies(rag, h200)
    assert not floor_applies(rag, {"device": "cuda", "device_name": "NVIDIA A100"})
    assert not floor_applies(rag, {"device": "cpu", "device_name": "AMD EPYC"})
    assert not floor_applies(WORKLOADS["no-share-gpu"], h200)


def test_percentiles_ignore_unknown_values():
    assert percentiles([None, None]) == (None, None)
    p50, p99 = percentiles([1.0, 2.0, 3.0, None, 4.0])
    assert p50 == pytest.approx(2.5) and 3.9 < p99 <= 4.0


def test_kvbatch_leaves_room_for_peers_on_cuda_only():
    from kvbatch.bench.harness import PEER_KV_FRACTION, leave_room_for_peers

    gpu = EngineOptions(device="cuda", dtype="bfloat16")
    both = BenchConfig(workload=TINY, model_path="x", engines=("kvbatch", "hf-static"), options=gpu)
    assert leave_room_for_peers(both).options.kv_cache_memory_fraction == PEER_KV_FRACTION
    alone = dataclasses.replace(both, engines=("kvbatch",))
    assert leave_room_for_peers(alone).options.kv_cache_memory_fraction is None
    chosen = dataclasses.replace(
        both, options=dataclasses.replace(gpu, kv_cache_memory_fraction=0.8)
    )
    assert leave_room_for_peers(chosen).options.kv_cache_memory_fraction == 0.8
    cpu = dataclasses.replace(both, options=EngineOptions())
    assert leave_room_for_peers(cpu).options.kv_cache_memory_fraction is None


def test_kvbatch_sync_is_kvbatch_with_async_scheduling_off(tiny_model):
    """The GPU check's `kvbatch-sync` row: the same engine, steps in turn, the same tokens."""
    options = EngineOptions(async_scheduling=True)
    fast, sync = (
        make_peer("kvbatch", tiny_model, options),
        make_peer("kvbatch-sync", tiny_model, options),
    )
    fast.load()
    sync.load()
    assert fast.llm.engine.async_scheduling is True
    assert sync.llm.engine.async_scheduling is False
    prompts = [[5 + i] * (9 + 7 * i) for i in range(4)]
    assert fast.generate(prompts, 6) == sync.generate(prompts, 6)


def test_freeze_gc_reaches_the_engine_from_the_command_line(tiny_model):
    """`--freeze-gc` (off by default on the CPU) freezes the engine's startup heap."""
    from kvbatch.engine.core.startup_heap import thaw_startup_heap

    parsed = cli.build_parser().parse_args(["rag", "--tiny", "--freeze-gc"])
    options = dataclasses.replace(EngineOptions(), freeze_gc=parsed.freeze_gc)
    peer = make_peer("kvbatch", tiny_model, options)
    try:
        peer.load()
        assert peer.llm.engine.frozen_gc_objects > 0
    finally:
        thaw_startup_heap()
    assert cli.build_parser().parse_args(["rag", "--tiny"]).freeze_gc is None


def test_kernel_profile_comes_after_a_checkpoint_of_the_timed_runs(tiny_model, monkeypatch):
    """The timed runs' report reaches `checkpoint` (the CLI writes its JSON there) before the
    profiled run; a profiler failure leaves a warning and the timings."""
    from kvbatch.bench import harness

    config = BenchConfig(
        workload=TINY, model_path=str(tiny_model), engines=("kvbatch",), kernel_profile=True
    )
    seen, drawn = [], []
    real_run_once = harness.run_once
    monkeypatch.setattr(
        harness, "run_once", lambda p, w, d: drawn.append(d.prompts) or real_run_once(p, w, d)
    )
    report = run_benchmark(config, checkpoint=lambda r: seen.append(dict(r.engines[0].extra)))
    assert len(seen) == 1 and "kernel_profile" not in seen[0] and "step_profile" in seen[0]
    profile = report.summary("kvbatch").extra["kernel_profile"]
    assert profile["reference_seconds"] == report.summary("kvbatch").seconds
    assert profile["steps"]["prefill"]["steps"] >= 1 and not report.warnings
    # the profiled run's prompts are new: none still in the prefix cache from a timed run
    *timed, profiled = drawn
    assert len(timed) == config.repeat
    assert not {tuple(p) for p in profiled} & {tuple(p) for d in timed for p in d}
    monkeypatch.setattr(harness, "run_once", real_run_once)

    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(harness, "profile_engine_run", broken)
    report = run_benchmark(config)
    assert "kernel_profile" not in report.summary("kvbatch").extra
    assert report.summary("kvbatch").seconds > 0
    assert report.warnings == ["kernel profile failed: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"]

    from kvbatch.bench.kernel_profile import summarize

    def traced_nothing(engine, run, reference_seconds=None):
        run()
        return summarize([], "cuda", profiled_seconds=1.0, reference_seconds=reference_seconds)

    monkeypatch.setattr(harness, "profile_engine_run", traced_nothing)
    report = run_benchmark(config)
    assert report.summary("kvbatch").extra["kernel_profile"]["busy_seconds"] == 0
    assert report.warnings == ["kernel profile traced no kernel: its busy share says nothing"]


def test_after_a_long_prompts_warm_up_kvbatch_captures_the_chunk_graphs_left(
    random_cache, monkeypatch
):
    """long-prefill's chunks are sized from step times, so a timed run may meet chunk buckets
    the warm-up did not: kvbatch captures them between the two (none on the CPU)."""
    from kvbatch.bench import harness

    calls = []
    inner = harness.run_once
    monkeypatch.setattr(
        harness, "run_once", lambda peer, w, d: calls.append(peer.name) or inner(peer, w, d)
    )
    after = KvbatchPeer.after_warmup
    monkeypatch.setattr(
        KvbatchPeer, "after_warmup", lambda peer: calls.append("after_warmup") or after(peer)
    )
    argv = ["long-prefill", "--tiny", "--threads", "1", "--full-warmup"]
    config = cli.config_from_args(cli.build_parser().parse_args(argv), "kvbatch bench")
    report = run_benchmark(config)
    assert calls == ["kvbatch", "after_warmup", "kvbatch"]
    assert report.summary("kvbatch").extra["graphs_captured_after_warmup"] == 0


def test_full_warmup_runs_kvbatch_once_on_a_draw_of_its_own(tiny_model, monkeypatch):
    """On CUDA (forced here) kvbatch runs the whole workload untimed before its timed runs, on
    prompts the timed draws do not share: the timed figures and cache hits stay the same."""
    from kvbatch.bench import harness

    calls = []
    inner = harness.run_once

    def spy(peer, workload, draw):
        calls.append((peer.name, workload.seed, draw.prompts[0][:8]))
        return inner(peer, workload, draw)

    monkeypatch.setattr(harness, "run_once", spy)
    after = KvbatchPeer.after_warmup
    monkeypatch.setattr(
        KvbatchPeer, "after_warmup", lambda peer: calls.append(("after_warmup",)) or after(peer)
    )
    w = dataclasses.replace(TINY, chunks_per_document=3)
    config = BenchConfig(
        workload=w,
        model_path=str(tiny_model),
        engines=("kvbatch", "hf-static"),
        options=EngineOptions(max_num_seqs=1),
        full_warmup=True,
    )
    report = run_benchmark(config)
    (warm_name, warm_seed, warm_prompt), *timed = calls  # no after_warmup: no long prompt
    assert warm_name == "kvbatch" and warm_seed == w.seed + harness.WARMUP_SEED_OFFSET
    assert [(name, seed) for name, seed, _ in timed] == [("kvbatch", w.seed), ("hf-static", w.seed)]
    assert warm_prompt != timed[0][2]
    # the warm-up's blocks are no help to the timed run: the same hits as without it
    assert report.summary("kvbatch").extra["cached_prompt_tokens"] == 2 * 2 * 32

    calls.clear()
    run_benchmark(dataclasses.replace(config, full_warmup=None))  # None: CUDA only
    assert [name for name, _, _ in calls] == ["kvbatch", "hf-static"]


def test_the_shared_tuning_flags_reach_the_engine(tiny_model):
    """The GPU tuning flags `kvbatch run` shares with the bench (kvbatch/engine_args.py) reach
    the benchmarked engine; left out, they leave its defaults."""
    argv = ["rag", "--tiny", "--model", str(tiny_model), "--enforce-eager"]
    argv += ["--cuda-graph-max-chunk", "0", "--long-prefill-token-threshold", "64"]
    argv += ["--long-prefill-step-ratio", "3", "--kv-cache-memory-fraction", "0.5"]
    argv += ["--kv-cache-dtype", "fp8"]
    config = cli.config_from_args(cli.build_parser().parse_args(argv), "test")
    peer = make_peer("kvbatch", config.model_path, config.options)
    peer.load()
    engine = peer.llm.engine
    assert (engine.config.cuda_graphs, engine.config.cuda_graph_max_chunk) == (False, 0)
    assert engine.config.scheduler.long_prefill_token_threshold == 64
    assert engine.config.scheduler.long_prefill_step_ratio == 3.0
    assert engine.config.cache.kv_cache_memory_fraction == 0.5
    assert engine.kv_dtype == torch.float8_e4m3fn
    plain = cli.config_from_args(cli.build_parser().parse_args(argv[:4]), "test").options
    assert plain == dataclasses.replace(EngineOptions(), hf_batch_size=plain.hf_batch_size)
