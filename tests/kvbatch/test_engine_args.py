"""The engine's flags on `kvbatch run`, `generate`, `worker` and `bench`: each reaches the engine
as its `engine.LLM` keyword, a flag left out leaves the engine's default, and a bad value stops
the command at parsing with a message naming the flag."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

from kvbatch.engine_args import add_engine_args, byte_size, engine_kwargs

BASE_KEYS = {  # the settings whose default is not None (None leaves the engine's)
    "device",
    "dtype",
    "max_num_seqs",
    "block_size",
    "enable_prefix_caching",
    "sliding_window_kv",
    "attention_backend",
}

EVERY_FLAG = [
    "--kv-cache-bytes", "3MiB",
    "--kv-cache-memory-fraction", "0.5",
    "--kv-cache-dtype", "fp8",
    "--long-prefill-token-threshold", "64",
    "--long-prefill-step-ratio", "3",
    "--cuda-graph-max-chunk", "0",
    "--enforce-eager",
    "--no-async-scheduling",
    "--no-cascade-attention",
    "--quantization", "fp8",
]  # fmt: skip


BENCH_FLAGS = {
    "--kv-cache-memory-fraction",
    "--kv-cache-dtype",
    "--long-prefill-token-threshold",
    "--long-prefill-step-ratio",
    "--cuda-graph-max-chunk",
    "--enforce-eager",
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvbatch run", exit_on_error=False)
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """kvbatch.cli.main in process: (exit status, stdout, stderr); argparse's exit included."""
    from kvbatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    levels = {n: logging.getLogger(n).level for n in ("kvbatch", "engine", "jobs")}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:
                status = e.code
    finally:  # `kvbatch run` sets our loggers to INFO
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "text, size",
    [("4GiB", 4 << 30), ("4G", 4 << 30), ("4gb", 4 << 30), ("512M", 512 << 20), ("1.5k", 1536)],
)
def test_sizes_read_in_binary_units(text, size):
    assert byte_size(text) == size
    assert byte_size(str(size)) == size
    assert byte_size(f"{size}B") == size


@pytest.mark.parametrize("text", ["", "4X", "GiB", "-1G", "0", "0.1"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        byte_size(text)


def test_flags_left_out_leave_the_engines_defaults():
    """Only the base settings are passed; the engine picks the rest by device (graphs, async
    scheduling and timed chunks on CUDA only)."""
    kwargs = engine_kwargs(parse())
    assert set(kwargs) == BASE_KEYS
    assert kwargs["enable_prefix_caching"] is True


def test_each_flag_becomes_its_engine_keyword():
    kwargs = engine_kwargs(parse(*EVERY_FLAG))
    assert {k: v for k, v in kwargs.items() if k not in BASE_KEYS} == dict(
        kv_cache_bytes=3 << 20,
        kv_cache_memory_fraction=0.5,
        kv_cache_dtype="fp8",
        long_prefill_token_threshold=64,
        long_prefill_step_ratio=3.0,
        cuda_graph_max_chunk=0,
        cuda_graphs=False,
        async_scheduling=False,
        cascade_attention=False,
        quantization="fp8",
    )
    assert engine_kwargs(parse("--async-scheduling"))["async_scheduling"] is True


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--kv-cache-memory-fraction", "1.5", "(0, 1]"),
        ("--kv-cache-memory-fraction", "0", "(0, 1]"),
        ("--kv-cache-bytes", "lots", "not a size"),
        ("--kv-cache-dtype", "int4", "invalid choice"),
        ("--long-prefill-step-ratio", "0.5", "above 1, or 0"),
        ("--long-prefill-token-threshold", "-1", ">= 0"),
        ("--cuda-graph-max-chunk", "x", "expected int"),
        ("--max-num-seqs", "0", ">= 1"),
        ("--max-num-batched-tokens", "-5", ">= 1"),
        ("--max-model-len", "0", ">= 1"),
        ("--block-size", "24", "power of two"),
        ("--num-speculative-tokens", "0", ">= 1"),
        ("--quantization", "int4", "invalid choice"),
    ],
)
def test_a_bad_value_stops_each_command_naming_the_flag(tmp_path: Path, flag, value, why):
    """At parsing: before a model loads, a broker is reached or an input is read."""
    missing = str(tmp_path / "nothing-here")
    commands = [
        ["run", missing, "--model", missing],
        ["generate", "--model", missing, "--prompt", "hi"],
        ["worker", "--model", missing, "--broker", "redis://127.0.0.1:1/0"],
    ]
    if flag in BENCH_FLAGS:  # the bench shares the GPU tuning flags
        commands.append(["bench", "rag", "--tiny"])
    for argv in commands:
        status, out, err = run_main([*argv, flag, value])
        assert status == 2, (argv, err)
        assert flag in err and why in err, err


def test_flags_that_cannot_go_together_stop_the_command(tmp_path: Path):
    missing = str(tmp_path / "nothing-here")
    argv = ["run", missing, "--model", missing, "--speculative", "ngram"]
    status, _, err = run_main([*argv, "--async-scheduling"])
    assert status == 2
    assert "--async-scheduling cannot go with --speculative" in err
    status, _, err = run_main([*argv, "--no-async-scheduling"])  # past parsing: no input
    assert status == 1 and "not found" in err


def test_every_command_that_runs_a_model_takes_the_flags():
    wanted = [f for f in EVERY_FLAG if f.startswith("--")]
    for command in ("run", "generate", "worker"):
        status, out, _ = run_main([command, "--help"])
        assert status == 0
        assert [f for f in wanted if f not in out] == [], command
    status, out, _ = run_main(["bench", "--help"])
    assert status == 0
    assert [f for f in sorted(BENCH_FLAGS) if f not in out] == []


def test_kvbatch_run_builds_its_engine_from_the_flags(
    tiny_chat_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A job through `kvbatch run` with every flag: answered, and the engine it ran on has
    the pool --kv-cache-bytes asks for (its start line says so) and the settings asked."""
    import torch

    from kvbatch import engine
    from kvbatch.engine import LLM
    from kvbatch.engine.exec.runner import kv_bytes_per_block

    engines = []

    class Recording(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self.engine)

    source = tmp_path / "in.jsonl"
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"count {i}", "max_tokens": 4},
        }
        for i in range(3)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["run", str(source), "--model", str(tiny_chat_model), "--device", "cpu"]
    argv += ["--max-model-len", "128", *EVERY_FLAG]
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, logger="kvbatch.engine"):
        mp.setattr(
            engine, "LLM", Recording
        )  # jobs/local/model_on_demand.py imports it when a line needs the model
        status, out, err = run_main(argv)
    assert status == 0, err
    assert "3 answered, 0 failed" in err
    (built,) = engines
    assert built.kv_dtype == torch.float8_e4m3fn  # --kv-cache-dtype fp8
    blocks = (3 << 20) // kv_bytes_per_block(built.model, 16, built.kv_dtype)
    assert built.kv.num_blocks == blocks
    assert f"KV cache (float8_e4m3fn): {blocks * 16} tokens ({blocks} blocks of 16)" in caplog.text
    # --kv-cache-bytes sets the pool: the fraction asked for beside it is named as unused
    assert "kv_cache_memory_fraction=0.5 is not used: kv_cache_bytes sets the pool" in caplog.text
    config = built.config
    assert (config.cuda_graphs, config.cascade_attention, built.async_scheduling) == (
        False,
        False,
        False,
    )
    assert config.cuda_graph_max_chunk == 0
    assert config.scheduler.long_prefill_token_threshold == 64
    assert config.scheduler.long_prefill_step_ratio == 3.0
    assert config.cache.kv_cache_memory_fraction == 0.5
