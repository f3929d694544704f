"""scripts/gpu_check_summary.py's long-prefill line, from results of today's and older runs."""

from __future__ import annotations

import json
from typing import Any

from tests.scripts import load_script

summary = load_script("gpu_check_summary")


def _results(figures: dict[str, Any], threshold: int | None = 512) -> dict[str, Any]:
    """A `kvbatch bench long-prefill --json` result with these long-prefill figures."""
    return {
        "workload": {"name": "long-prefill"},
        "options": {"long_prefill_token_threshold": threshold},
        "engines": [{"engine": "kvbatch", "long_prefill": figures}],
    }


NEW = {  # the H200 run with a 512-token cap, as timed since plain decode steps are told apart
    "max_token_gap_s": 0.0156,
    "max_token_gap_observed_s": 0.0155,
    "median_decode_step_s": 0.0015,
    "decode_step_reference": "plain decode steps",
    "median_prefill_step_s": 0.0083,
    "prefill_steps": 64,
    "gap_ratio": 10.4,
    "long_prompt_tokens": 32768,
    "long_prompt_ttft_s": 0.61,
    "steps": 300,
}


def test_the_line_compares_the_gap_with_a_plain_decode_step():
    head, target = summary.long_prefill_lines(_results(NEW))
    assert head == (
        "long-prefill (long_prefill_token_threshold 512): longest token gap 15.6 ms, "
        "plain decode step 1.5 ms, ratio 10.4 decode steps; steps while prefilling: 64, "
        "median 8.3 ms; the long prompt's first token after 610.0 ms"
    )
    assert target == "target (<= 3 decode steps): MISSED"


def test_without_plain_decode_steps_the_line_says_what_the_reference_is():
    figures = NEW | {"decode_step_reference": "all token gaps", "gap_ratio": 1.9}
    head, target = summary.long_prefill_lines(_results(figures, threshold=None))
    assert "(long_prefill_token_threshold default)" in head
    assert "median token gap (no plain decode step) 1.5 ms, ratio 1.9" in head
    assert target == "target (<= 3 decode steps): MET"


def test_older_results_without_the_new_fields_still_print():
    old = {k: NEW[k] for k in NEW if k not in ("decode_step_reference", "prefill_steps")}
    del old["median_prefill_step_s"]
    old |= {"median_decode_step_s": 0.0083, "gap_ratio": 1.9}  # the median of mixed steps
    head, target = summary.long_prefill_lines(_results(old))
    assert "longest token gap 15.6 ms, median decode step 8.3 ms, ratio 1.9 decode steps;" in head
    assert "plain" not in head and "prefilling" not in head
    assert target == "target (<= 3 decode steps): MET"
    head, target = summary.long_prefill_lines(_results({}))  # a run that measured nothing
    assert "median decode step - ms, ratio - decode steps; the long prompt" in head
    assert target == "target (<= 3 decode steps): not measured"


def test_the_line_names_the_step_ratio_and_the_longest_gap_while_prefilling():
    data = _results(NEW | {"max_token_gap_prefilling_s": 0.0041, "prefilling_gap_ratio": 2.7})
    data["options"]["long_prefill_step_ratio"] = None
    head, _ = summary.long_prefill_lines(data)
    assert "(long_prefill_token_threshold 512, long_prefill_step_ratio default)" in head
    assert "; longest gap while prefilling 4.1 ms (ratio 2.7);" in head
    data["options"]["long_prefill_step_ratio"] = 0.0
    assert ", long_prefill_step_ratio 0)" in summary.long_prefill_lines(data)[0]


def test_the_line_says_when_mixed_steps_ran_eagerly():
    data = _results(NEW)
    assert "eager" not in summary.long_prefill_lines(data)[0]
    data["options"]["cuda_graph_max_chunk"] = 0
    assert ", mixed steps eager (cuda_graph_max_chunk 0))" in summary.long_prefill_lines(data)[0]


def test_the_line_says_when_the_startup_heap_was_not_frozen():
    data = _results(NEW)
    data["options"]["freeze_gc"] = None  # the default: frozen on CUDA
    assert "frozen" not in summary.long_prefill_lines(data)[0]
    data["options"]["freeze_gc"] = False
    data["engines"][0]["long_prefill"]["gc"] = {
        "collections": [40, 4, 1],
        "full_passes": 1,
        "longest_pause_prefilling_s": 0.0183,
    }
    head = summary.long_prefill_lines(data)[0]
    assert ", startup heap not frozen (--no-freeze-gc))" in head
    assert "; 1 full GC passes in the run, longest GC pause while prefilling 18.30 ms" in head


def test_the_lines_count_the_steps_that_replayed_graphs():
    data = _results(NEW)
    profile = {"steps": 300, "graph_steps": 280, "mixed_graph_steps": 60, "graph_captures": 1}
    data["engines"][0]["extra"] = {"step_profile": profile | {"graph_first_launches": 2}}
    head, graphs, target = summary.long_prefill_lines(data)
    assert graphs == (
        "CUDA graphs: 280 of 300 steps replayed one, 60 of them with a prompt chunk, "
        "1 captured in the run, 2 launched for the first time (last run)"
    )
    assert len(summary.long_prefill_lines(_results(NEW))) == 2  # no profile, no line


def test_the_line_says_how_much_graphs_padded_the_timed_chunks():
    cost = {"ratio": 2.5, "mixed_steps": 40, "plain_step_s": 0.0014, "cost_per_work_s": 4e-6}
    cost |= {"largest_chunk": 384, "mixed_tokens": 8000, "mixed_rows": 8400}
    head = summary.long_prefill_lines(_results(NEW | {"step_cost": cost}))[0]
    assert "largest chunk 384, chunks padded to graph buckets: 5% more rows than tokens" in head
    unpadded = cost | {"mixed_rows": 8000}  # eager mixed steps (or results from before)
    head = summary.long_prefill_lines(_results(NEW | {"step_cost": unpadded}))[0]
    assert "largest chunk 384" in head and "padded" not in head


def test_the_graphs_line_counts_those_captured_after_the_warm_up():
    data = _results(NEW)
    profile = {"steps": 300, "graph_steps": 280, "mixed_graph_steps": 60, "graph_captures": 0}
    data["engines"][0]["extra"] = {"step_profile": profile, "graphs_captured_after_warmup": 7}
    graphs = summary.long_prefill_lines(data)[1]
    assert graphs.endswith(
        "0 launched for the first time (last run); 7 more captured after the warm-up"
    )
    # and launched once then (engine/exec/cuda_graphs.py FirstLaunches): the first time against
    # again
    launches = dict(graphs=7, first_host_ms=1.2, first_device_ms=9.5)
    launches |= dict(again_host_ms=0.3, again_device_ms=4.31)
    data["engines"][0]["extra"]["graph_launches_after_warmup"] = launches
    assert summary.long_prefill_lines(data)[1].endswith(
        "7 more captured after the warm-up and launched once: 9.5 ms on the device (1.2 on the "
        "host) the first time, 4.3 (0.3) again"
    )
    data["engines"][0]["extra"]["graphs_captured_after_warmup"] = 0
    data["engines"][0]["extra"]["graph_launches_after_warmup"] = None
    assert "warm-up" not in summary.long_prefill_lines(data)[1]


def _rag(engines: dict[str, float]) -> dict[str, Any]:
    """A `kvbatch bench rag --json` result on an H200 with these engines' seconds."""
    rows = [
        {"engine": name, "seconds": s, "tokens_per_s": 32768 / s, "ratio": s / engines["kvbatch"]}
        for name, s in engines.items()
    ]
    return {
        "workload": {"name": "rag"},
        "machine": {"device": "cuda", "device_name": "NVIDIA H200"},
        "date": "2026-12-02",
        "floor": {"seconds": 0.4, "device": "H200", "applies": True},
        "engines": rows,
    }


def _steps(folder, **status: str) -> None:
    lines = ["step\tstatus\trc\tseconds\tlimit\tlast line"]
    lines += [f"{step}\t{s}\t0\t9\t90\t" for step, s in status.items()]
    (folder / "steps.tsv").write_text("\n".join(lines) + "\n")


def test_the_hf_cb_step_gets_its_own_table_and_no_second_verdict(tmp_path):
    (tmp_path / "rag.json").write_text(json.dumps(_rag({"kvbatch": 0.82, "hf-static": 10.7})))
    (tmp_path / "rag-hf-cb.json").write_text(json.dumps(_rag({"kvbatch": 0.85, "hf-cb": 3.4})))
    _steps(tmp_path, rag="ok", **{"rag-hf-cb": "ok"})
    text = summary.summary(tmp_path)
    assert text.count("target (<= 1.5 s on an H200): MET (0.82 s; goal 1.0 s met)") == 1
    assert "0.85" not in text.split("rag with hf-cb (its own step):")[0]
    hf_cb = text.split("rag with hf-cb (its own step):")[1]
    assert "hf-cb" in hf_cb and "3.40" in hf_cb and "4.00" in hf_cb  # seconds, ratio
    assert "target" not in hf_cb.split("long-prefill")[0]

    (tmp_path / "rag-hf-cb.json").unlink()  # the step failed: said so under its heading
    _steps(tmp_path, rag="ok", **{"rag-hf-cb": "TIMEOUT"})
    hf_cb = summary.summary(tmp_path).split("rag with hf-cb (its own step):")[1]
    assert hf_cb.lstrip().startswith("rag: no results (the step failed or timed out")
    _steps(tmp_path, rag="ok", **{"rag-hf-cb": "skipped"})  # RAG_HF_CB=0, or no time left
    assert "rag with hf-cb" not in summary.summary(tmp_path)


def test_rag_moe_and_rag_qwen3_get_their_own_tables_and_no_verdict(tmp_path):
    (tmp_path / "rag.json").write_text(json.dumps(_rag({"kvbatch": 0.82, "hf-static": 10.7})))
    moe = _rag({"kvbatch": 1.5, "hf-static": 9.0}) | {"workload": {"name": "rag-moe"}}
    qwen3 = _rag({"kvbatch": 1.25, "hf-static": 7.5}) | {"workload": {"name": "rag-qwen3"}}
    qwen3["greedy_match"] = [{"engine": "hf-static", "reference": "kvbatch", "matching": 4,
                              "compared": 4}]  # fmt: skip
    (tmp_path / "moe-rag.json").write_text(json.dumps(moe))
    (tmp_path / "qwen3-rag.json").write_text(json.dumps(qwen3))
    _steps(tmp_path, rag="ok", **{"rag-moe": "ok", "rag-qwen3": "ok"})
    text = summary.summary(tmp_path)
    assert text.count("target (<= 1.5 s on an H200)") == 1  # the rag step's alone
    moe_part, qwen3_part = text.split("rag-moe (its own step):")[1].split(
        "rag-qwen3 (its own step):"
    )
    assert "rag-moe on cuda (NVIDIA H200)" in moe_part and "9.00" in moe_part
    assert "rag-qwen3 on cuda (NVIDIA H200)" in qwen3_part
    assert "7.50" in qwen3_part and "6.00" in qwen3_part  # seconds, ratio
    assert "greedy tokens hf-static vs kvbatch: 4/4" in qwen3_part

    (tmp_path / "qwen3-rag.json").unlink()  # the step failed: said so under its heading
    _steps(tmp_path, rag="ok", **{"rag-moe": "skipped", "rag-qwen3": "TIMEOUT"})
    text = summary.summary(tmp_path)
    assert "rag-moe (its own step)" not in text
    qwen3_part = text.split("rag-qwen3 (its own step):")[1]
    assert qwen3_part.lstrip().startswith("rag: no results (the step failed or timed out")
    _steps(tmp_path, rag="ok", **{"rag-qwen3": "skipped"})  # past BUDGET_S, or not --only
    assert "rag-qwen3 (its own step)" not in summary.summary(tmp_path)


def _bench(workload: str, seconds: float, stats: dict[str, Any], **options) -> dict[str, Any]:
    """A `kvbatch bench --json` result of kvbatch alone with these LLM.stats()."""
    return {
        "workload": {"name": workload},
        "options": {"max_num_seqs": 256, "dtype": "bfloat16", "kv_cache_dtype": None, **options},
        "engines": [
            {"engine": "kvbatch", "seconds": seconds, "tokens_per_s": 1000 / seconds,
             "extra": {"stats": stats}},
        ],
    }  # fmt: skip


def test_quantized_rows_compare_with_their_workload_s_float_row(tmp_path):
    float_stats = {"weight_bytes": 2 << 30, "num_kv_blocks": 1000, "block_size": 16,
                   "kv_cache_dtype": "bfloat16", "quantization": None}  # fmt: skip
    fp8_stats = {**float_stats, "weight_bytes": 1 << 30, "quantization": "fp8",
                 "num_kv_blocks": 2000, "kv_cache_dtype": "float8_e4m3fn"}  # fmt: skip
    rows = {
        "quant-no-share-bf16": _bench("no-share-gpu", 2.0, float_stats),
        "quant-no-share-fp8-kv": _bench("no-share-gpu", 1.25, fp8_stats, kv_cache_dtype="fp8"),
        "quant-rag-fp8": _bench("rag", 0.5, fp8_stats),
    }
    for name, data in rows.items():  # written in order: the table keeps it
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "rag.json").write_text(json.dumps(_bench("rag", 0.8, float_stats)))
    (tmp_path / "quant-broken.json").write_text("{")
    lines = summary.quant_lines(tmp_path)
    by_row = {line.split()[0]: line.split() for line in lines[2:]}
    assert by_row["no-share-bf16"][7] == "1.00" and by_row["no-share-bf16"][9] == "16000"
    assert by_row["no-share-fp8-kv"][3:5] == ["fp8", "float8_e4m3fn"]
    assert by_row["no-share-fp8-kv"][7] == "1.60"  # 2.0 s / 1.25 s
    assert by_row["no-share-fp8-kv"][8:] == ["1.000", "32000"]  # GiB, KV tokens
    assert by_row["rag-fp8"][7] == "1.60"  # against the rag step's kvbatch row
    assert by_row["broken"][1:3] == ["no", "results"]


def _gemma_window(identical: bool) -> dict[str, Any]:
    """A `kvbatch bench gemma-window --json` result: window KV on holds 4x the sequences."""

    def mode(name: str, running: int, seconds: float) -> dict[str, Any]:
        return {"mode": name, "seconds": seconds, "output_tokens": 16384, "steps": 900,
                "max_running": running, "mean_running": running - 0.5, "num_kv_blocks": 4224,
                "num_preemptions": 3, "tokens_per_s": 16384 / seconds}  # fmt: skip

    return {
        "machine": {"device": "cuda", "device_name": "NVIDIA H200"},
        "model": {"name": "gemma-3-1b", "window": 512},
        "date": "2026-12-05",
        "job": {
            "num_prompts": 64,
            "prompt_tokens": 8192,
            "output_tokens": 256,
            "kv_cache_bytes": 8 * 528 * 16 * 26624,
        },  # fmt: skip
        "modes": {"off": mode("off", 9, 20.0), "on": mode("on", 36, 8.0)},
        "ratios": {"max_running": 4.0, "mean_running": 35.5 / 8.5, "tokens_per_s": 2.5},
        "greedy_identical": identical,
    }


def test_rag_gemma_gets_a_table_of_both_modes_and_their_ratios(tmp_path):
    (tmp_path / "gemma-window.json").write_text(json.dumps(_gemma_window(True)))
    _steps(tmp_path, **{"rag-gemma": "ok"})
    part = summary.summary(tmp_path).split("gemma-window: gemma-3-1b (window 512) on cuda")[1]
    assert "64 prompts of 8192 tokens, 256 out, KV budget 1,716 MiB" in part
    off, on = (line.split() for line in part.splitlines()[2:4])
    assert off[:3] == ["off", "4224", "9"] and on[:3] == ["on", "4224", "36"]
    assert on[-2:] == ["8.00", "2048.0"]  # seconds, tokens/s
    assert "on/off: sequences at once 4.00x (most), 4.18x (mean); throughput 2.50x; " in part
    assert "greedy tokens identical" in part

    (tmp_path / "gemma-window.json").write_text(json.dumps(_gemma_window(False)))
    assert "greedy tokens DIFFER" in summary.summary(tmp_path)
    (tmp_path / "gemma-window.json").unlink()  # the step failed: said so
    _steps(tmp_path, **{"rag-gemma": "TIMEOUT"})
    assert "gemma-window: no results (the step failed" in summary.summary(tmp_path)
    _steps(tmp_path, **{"rag-gemma": "skipped"})  # past BUDGET_S, or not --only
    assert "gemma-window" not in summary.summary(tmp_path)
