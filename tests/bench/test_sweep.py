"""`kvbatch bench --sweep`: the grid, its parsing, and a two-cell run on the tiny rag."""

from __future__ import annotations

import json

import pytest

from kvbatch.bench import cli
from kvbatch.bench.sweep import (
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_KV_FRACTIONS,
    DEFAULT_MAX_NUM_SEQS,
    SweepGrid,
    parse_list,
)
from tests.scripts import load_script


def test_parse_list():
    assert parse_list("128, 256,512", int, "--x") == (128, 256, 512)
    assert parse_list("0.85,0.9", float, "--x") == (0.85, 0.9)
    with pytest.raises(ValueError, match="--x"):
        parse_list("128,abc", int, "--x")
    with pytest.raises(ValueError, match="at least one"):
        parse_list(" , ", int, "--x")


def test_default_grid_and_cell_order():
    grid = SweepGrid()
    assert grid.max_num_seqs == DEFAULT_MAX_NUM_SEQS == (128, 256, 512)
    assert grid.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS == (4096, 8192, 16384)
    assert grid.kv_cache_memory_fraction == DEFAULT_KV_FRACTIONS == (0.85, 0.90, 0.92)
    cells = grid.cells()
    assert len(cells) == 27
    assert cells[0] == (128, 4096, 0.85) and cells[1] == (128, 4096, 0.90)
    assert cells[-1] == (512, 16384, 0.92)
    assert grid.for_device("cuda:0") is grid
    assert grid.for_device("cpu").kv_cache_memory_fraction == (0.85,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seqs=()), "at least one"),
        (dict(max_num_seqs=(4, 4)), "twice"),
        (dict(max_num_batched_tokens=(0,)), ">= 1"),
        (dict(kv_cache_memory_fraction=(1.5,)), r"\(0, 1\]"),
    ],
)
def test_bad_grids_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SweepGrid(**kwargs)


def test_cli_grid_flags_and_errors(capsys):
    args = cli.build_parser().parse_args(
        [
            "rag",
            "--sweep",
            "--sweep-max-num-seqs",
            "8,16",
            "--sweep-kv-cache-memory-fraction",
            "0.5",
        ]
    )
    grid = cli.sweep_grid_from_args(args)
    assert grid.max_num_seqs == (8, 16) and grid.kv_cache_memory_fraction == (0.5,)
    assert grid.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS
    assert cli.main(["rag", "--tiny", "--sweep", "--peers", "hf-static"]) == 2
    assert "kvbatch alone" in capsys.readouterr().err
    assert cli.main(["rag", "--tiny", "--sweep", "--sweep-max-num-seqs", "x"]) == 2


def test_sweep_runs_each_cell_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sweep.json"
    argv = ["rag", "--tiny", "--sweep", "--sweep-max-num-seqs", "2,16"]
    argv += ["--sweep-max-num-batched-tokens", "128", "--sweep-kv-cache-memory-fraction", "0.8,0.9"]
    argv += ["--threads", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "highest throughput" in printed and "TPOT p99" in printed
    assert "on the CPU one value" in printed  # the fraction axis collapses on the CPU
    data = json.loads(out.read_text())
    assert data["kind"] == "sweep"
    assert data["grid"]["kv_cache_memory_fraction"] == [0.8]
    cells = data["cells"]
    assert [(c["max_num_seqs"], c["max_num_batched_tokens"]) for c in cells] == [
        (2, 128),
        (16, 128),
    ]
    for c in cells:
        assert c["error"] is None
        assert c["seconds"] > 0 and c["tokens_per_s"] > 0
        assert 0 < c["ttft_p50"] <= c["ttft_p99"] and 0 < c["tpot_p50"] <= c["tpot_p99"]
        assert c["num_kv_blocks"] > 0
    # two sequences at a time: the last requests wait for the first ones
    assert cells[0]["ttft_p99"] > cells[1]["ttft_p99"]

    # the GPU check's summary lists the cells and the fastest one
    folder = tmp_path / "check"
    folder.mkdir()
    data["cells"].append({**cells[0], "max_num_seqs": 512, "error": "OutOfMemoryError: CUDA"})
    (folder / "rag-sweep.json").write_text(json.dumps(data))
    text = load_script("gpu_check_summary").summary(folder)
    assert "rag-tiny sweep (kvbatch alone, one engine per cell):" in text
    fastest = min(cells, key=lambda c: c["seconds"])
    assert f"fastest: max_num_seqs {fastest['max_num_seqs']}, " in text
    assert "OutOfMemoryError: CUDA" in text
