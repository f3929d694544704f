"""`kvbatch bench gemma-window` at its tiny size (bench/gemma_window.py): both modes run on one
KV budget, their figures and JSON, and the greedy tokens compared between them.

No test asserts speed or that window KV holds more sequences than without: only that it never
holds fewer, which holds before window KV groups free anything and after."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from transformers import AutoConfig

from kvbatch.bench import cli
from kvbatch.bench.gemma_window import (
    SIZES,
    ModeRun,
    checkpoint_dir,
    first_difference,
    kv_bytes_per_token,
    verdict_line,
)

TINY = SIZES["tiny"]
ROW_KEYS = {
    "mode",
    "seconds",
    "output_tokens",
    "steps",
    "max_running",
    "mean_running",
    "num_kv_blocks",
    "num_preemptions",
    "tokens_per_s",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run through `kvbatch bench`: (exit status, printed text, JSON)."""
    folder = tmp_path_factory.mktemp("gemma-window")
    out = folder / "gw.json"
    argv = ["gemma-window", "--size", "tiny", "--threads", "1", "--cache-dir", str(folder)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main([*argv, "--json", str(out)])
    return status, printed.getvalue(), json.loads(out.read_text())


def test_both_modes_run_and_agree(tiny_run):
    status, printed, result = tiny_run
    assert status == 0
    assert result["greedy_identical"] is True and result["first_difference"] is None
    last = printed.splitlines()[-1]  # the GPU check's steps table shows it
    assert last.startswith("gemma-window on/off: sequences at once ")
    assert last.endswith("; greedy tokens identical")
    assert set(result["modes"]) == {"on", "off"}
    for mode, row in result["modes"].items():
        assert set(row) == ROW_KEYS and row["mode"] == mode
        assert row["output_tokens"] == TINY.num_prompts * TINY.output_tokens
        assert row["max_running"] >= 1 and 0 < row["mean_running"] <= row["max_running"]
        assert row["steps"] >= TINY.output_tokens and row["num_kv_blocks"] > 0
        assert row["seconds"] > 0 and row["tokens_per_s"] > 0
    on, off = result["modes"]["on"], result["modes"]["off"]
    assert on["max_running"] >= off["max_running"]
    r = result["ratios"]
    assert r["max_running"] == pytest.approx(on["max_running"] / off["max_running"])
    assert r["tokens_per_s"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])


def test_the_budget_holds_the_asked_whole_sequences_without_window_kv(tiny_run):
    _, printed, result = tiny_run
    job = result["job"]
    blocks = math.ceil((job["prompt_tokens"] + job["output_tokens"]) / job["block_size"])
    per_block = kv_bytes_per_token(TINY.shape) * job["block_size"]
    assert job["kv_cache_bytes"] == TINY.budget_seqs * blocks * per_block
    assert result["modes"]["off"]["num_kv_blocks"] == TINY.budget_seqs * blocks
    # the job needs more than the budget holds, so sequences wait their turn without window KV
    assert TINY.num_prompts > result["modes"]["off"]["max_running"]
    assert result["machine"]["torch_threads"] == 1
    assert result["command"].startswith("kvbatch bench gemma-window --size tiny")
    assert f"{TINY.shape.num_hidden_layers} layers, 5 windowed, window {TINY.window}" in printed


def test_the_checkpoint_is_gemma3_with_five_local_layers_to_one_global(tmp_path):
    folder = checkpoint_dir(TINY.shape, 48, 512, tmp_path)
    assert checkpoint_dir(TINY.shape, 48, 512, tmp_path) == folder  # built once, then reused
    assert checkpoint_dir(TINY.shape, 64, 512, tmp_path) != folder  # another window, another
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["Gemma3ForCausalLM"] and config.sliding_window == 48
    assert config.layer_types.count("sliding_attention") == 5
    assert config.layer_types[-1] == "full_attention"


def test_differing_tokens_are_named_and_fail_the_verdict():
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert first_difference([[1, 2]], [[1]]) == (0, 1)  # one stopped early
    off = ModeRun("off", 2.0, 100, 60, 4, 3.5, 40, 2, [[1, 2], [3, 4]])
    on = ModeRun("on", 1.0, 100, 30, 8, 7.0, 40, 0, [[1, 2], [3, 5]])
    line = verdict_line({"on": on, "off": off}, first_difference(off.token_ids, on.token_ids))
    assert line.startswith("gemma-window FAIL: greedy tokens differ")
    assert "(request 1, token 1)" in line
    assert "sequences at once 2.00x (most), 2.00x (mean); throughput 2.00x" in line


def test_help_is_the_bench_s_own(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["gemma-window", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-cache-bytes" in out and "window KV on and off" in out
