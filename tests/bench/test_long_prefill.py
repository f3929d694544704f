"""`kvbatch bench long-prefill` on the tiny model (bench/long_prefill.py): the gap
figures, the chunk caps and timed chunks, and the GPU check's lines for them."""

from __future__ import annotations

import json

import pytest

from kvbatch.bench import cli
from kvbatch.bench.peers import make_peer
from kvbatch.bench.step_profile import PHASES
from kvbatch.bench.workloads import TINY_WORKLOADS as WORKLOADS_TINY
from tests.scripts import load_script


def test_long_prefill_tiny_reports_the_gap(random_cache, tmp_path, capsys):
    out = tmp_path / "lp.json"
    argv = ["long-prefill", "--tiny", "--json", str(out), "--threads", "1"]
    argv += ["--max-num-batched-tokens", "256"]  # the 2048-token prompt takes 8 steps
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "longest token gap" in printed and ", plain decode step " in printed
    (kv,) = json.loads(out.read_text())["engines"]
    w = WORKLOADS_TINY["long-prefill"]
    assert kv["output_tokens"] == w.num_requests * w.output_len  # the decoders' tokens only
    f = kv["long_prefill"]
    assert f["long_prompt_tokens"] == w.long_prompt_len
    assert 0 < f["median_decode_step_s"] <= f["max_token_gap_s"]
    assert f["gap_ratio"] == pytest.approx(f["max_token_gap_s"] / f["median_decode_step_s"])
    assert 0 < f["long_prompt_arrival_s"] < kv["seconds"]
    assert f["long_prompt_ttft_s"] > 0
    # one step per decoder token at least (the long prompt's chunks ride along with decodes)
    assert f["steps"] >= w.output_len
    # the reference is a plain decode step: the prefill's steps (256 tokens at most each, so
    # 8 or more) are timed apart, and a step with a chunk in it takes far longer on the CPU
    assert f["decode_step_reference"] == "plain decode steps"
    assert w.long_prompt_len // 256 <= f["prefill_steps"] < f["steps"] - w.long_prompt_after
    assert f["median_prefill_step_s"] > f["median_decode_step_s"]
    assert f"; steps while prefilling: {f['prefill_steps']}, median " in printed
    # the collector's passes during the run, and the longest inside the prefill window
    assert len(f["gc"]["collections"]) == 3 and "longest_pause_prefilling_s" in f["gc"]
    assert f"; {f['gc']['full_passes']} full GC passes in the run, longest GC pause " in printed
    # the slowest steps, slowest first, each labelled; on the CPU a step with a 256-token
    # chunk costs several decode steps, so the prefill's 8 or more are among them
    longest = f["longest_steps"]
    assert len(longest) == 5 and [s["ms"] for s in longest] == sorted(
        (s["ms"] for s in longest), reverse=True
    )
    assert len({s["step"] for s in longest}) == 5 and all(
        0 <= s["step"] < f["steps"] for s in longest
    )
    assert "prefilling" in {s["kind"] for s in longest}
    assert {s["kind"] for s in longest} <= {"start", "prefilling", "long decoding", "plain"}
    # each explained by the step profile: its phases fit inside the step's wall time
    for s in longest:
        assert 0 < sum(s["detail"][f"{k}_ms"] for k in PHASES) <= s["ms"] + 0.01

    # the GPU check's summary: the default run and the one with another chunk cap, labelled
    alt = tmp_path / "alt.json"
    assert cli.main(argv[:2] + ["--json", str(alt), "--long-prefill-token-threshold", "128"]) == 0
    # a small cap: most steps of the run carry a chunk, yet the reference stays a plain step
    small = json.loads(alt.read_text())["engines"][0]["long_prefill"]
    assert small["prefill_steps"] > max(f["prefill_steps"], small["steps"] // 2)
    assert small["decode_step_reference"] == "plain decode steps"
    folder = tmp_path / "check"
    folder.mkdir()
    out.rename(folder / "long-prefill.json")
    alt.rename(folder / "long-prefill-128.json")
    other = json.loads((folder / "long-prefill-128.json").read_text())
    other["options"]["long_prefill_token_threshold"] = 1024  # stands for a second cap's run
    (folder / "long-prefill-1024.json").write_text(json.dumps(other))
    text = load_script("gpu_check_summary").summary(folder)
    ratio = ", long_prefill_step_ratio default): longest"
    default = text.index(f"long-prefill-tiny (long_prefill_token_threshold default{ratio}")
    high = text.index(f"long-prefill-tiny (long_prefill_token_threshold 1024{ratio}")
    low = text.index(f"long-prefill-tiny (long_prefill_token_threshold 128{ratio}")
    assert default < high < low  # the default, then the caps from high to low
    assert text.count("target (<= 3 decode steps)") == 3
    assert text.count("ms, plain decode step ") == 3
    assert f"steps while prefilling: {f['prefill_steps']}, median " in text
    first = f["longest_steps"][0]
    detail = first["detail"]
    host = sum(detail[f"{k}_ms"] for k in PHASES if k != "sample")
    assert (
        f"longest steps: {first['ms']:.1f} ms (step {first['step']}, {first['kind']}; "
        f"host {host:.1f} ms, waiting {detail['sample_ms']:.1f} ms), "
    ) in text


def test_long_prefill_refuses_peers_that_cannot_add_a_prompt_mid_run(random_cache, capsys):
    assert cli.main(["long-prefill", "--tiny", "--peers", "hf-static"]) == 2
    assert "kvbatch alone" in capsys.readouterr().err


def test_long_prefill_token_threshold_reaches_the_engine(random_cache, capsys):
    """`--long-prefill-token-threshold` sets kvbatch's chunk cap (the gap/TTFT trade-off),
    `--long-prefill-step-ratio` its timed chunks."""
    argv = ["long-prefill", "--tiny", "--long-prefill-token-threshold", "256"]
    argv += ["--long-prefill-step-ratio", "3"]
    config = cli.config_from_args(cli.build_parser().parse_args(argv), "kvbatch bench")
    assert config.options.long_prefill_token_threshold == 256
    assert config.options.long_prefill_step_ratio == 3
    peer = make_peer("kvbatch", config.model_path, config.options)
    peer.load()
    assert peer.llm.engine.scheduler.config.long_prefill_token_threshold == 256
    assert peer.llm.engine.step_cost.ratio == 3


def test_long_prefill_with_timed_chunks_reports_what_the_engine_learned(
    random_cache, tmp_path, capsys
):
    """The CPU run with timed chunks (off by default on the CPU): the 2,048-token prompt is
    longer than a 1,024 threshold, so its chunks start at the probe and follow the fit; the
    figures carry the fit and the longest wait while the prompt was prefilled."""
    argv = ["long-prefill", "--tiny", "--threads", "1", "--long-prefill-token-threshold", "1024"]
    runs, figures = {}, {}
    for ratio in ("0", "2.5"):
        out = tmp_path / f"lp-{ratio}.json"
        assert cli.main(argv + ["--long-prefill-step-ratio", ratio, "--json", str(out)]) == 0
        runs[ratio] = capsys.readouterr().out
        figures[ratio] = json.loads(out.read_text())["engines"][0]["long_prefill"]
    assert "timed chunks (ratio 2.5) over " in runs["2.5"]
    assert "timed chunks" not in runs["0"] and figures["0"]["step_cost"] is None
    timed, untimed = figures["2.5"], figures["0"]
    cost = timed["step_cost"]
    assert cost["mixed_steps"] >= 1 and cost["plain_step_s"] > 0 and cost["ratio"] == 2.5
    assert cost["cost_per_work_s"] >= 0 and cost["largest_chunk"] >= 64
    assert timed["prefill_steps"] >= untimed["prefill_steps"]  # never above the token cap
    for f in (timed, untimed):
        assert 0 < f["max_token_gap_prefilling_s"] <= f["max_token_gap_observed_s"]
        assert f["prefilling_gap_ratio"] == pytest.approx(
            f["max_token_gap_prefilling_s"] / f["median_decode_step_s"]
        )


def test_step_kinds_name_what_a_step_held():
    from types import SimpleNamespace

    from kvbatch.bench.long_prefill import _step_kind

    long = SimpleNamespace(num_output_tokens=3, is_finished=False)
    assert _step_kind(True, False, long) == "prefilling"
    assert _step_kind(False, False, None) == "start"
    assert _step_kind(False, True, None) == "plain"
    assert _step_kind(False, True, long) == "long decoding"
    assert (
        _step_kind(False, True, SimpleNamespace(num_output_tokens=9, is_finished=True)) == "plain"
    )


def test_longest_steps_text_explains_a_step_with_its_device_time_and_graph():
    from kvbatch.bench.long_prefill import longest_steps_text

    detail = {"schedule_ms": 0.1, "prepare_ms": 0.6, "forward_ms": 0.1, "rest_ms": 0.1}
    detail |= {"sample_ms": 4.2, "collected_device_ms": 3.9}
    detail["graph"] = "64 decodes + a 32-token chunk, wide tables"
    steps = [{"step": 213, "ms": 5.3, "kind": "prefilling", "detail": detail}]
    steps.append({"step": 0, "ms": 12.0, "kind": "start"})  # results without details
    assert longest_steps_text({"longest_steps": steps}) == (
        "5.3 ms (step 213, prefilling; host 0.9 ms, waiting 4.2 ms, collected step 3.9 ms on "
        "the device, graph of 64 decodes + a 32-token chunk, wide tables), 12.0 ms (step 0, start)"
    )
