"""`python -m studies step-plan`: the scheduler's steps of a workload, with the model stubbed."""

from __future__ import annotations

from kvbatch.bench.workloads import get_workload
from studies.registry import run
from studies.step_plan import plan


def test_more_sequences_fewer_decode_steps_and_shared_documents_computed_once():
    w = get_workload("rag", tiny=True)  # 16 requests = 4 documents x 4 chunks, 8 tokens out
    waves = plan(w, max_num_seqs=4, max_num_batched_tokens=4096)
    at_once = plan(w, max_num_seqs=16, max_num_batched_tokens=4096)
    for p in (waves, at_once):
        assert p["steps"] == p["decode_steps"] + p["prefill_steps"] + p["mixed_steps"]
        assert p["prompt_tokens"] == 16 * w.prompt_len
        # each 64-token document is computed once; the other 12 chunks compute their own 24
        assert p["prompt_tokens_computed"] == 4 * w.prompt_len + 12 * (w.prompt_len - 64)
    # all 16 at once: one prefill step, then the 7 decode steps after each first token
    assert (at_once["prefill_steps"], at_once["mixed_steps"], at_once["decode_steps"]) == (1, 0, 7)
    assert waves["decode_steps"] + waves["mixed_steps"] >= 4 * 7  # four waves of four


def test_cli_prints_one_row_per_cell(capsys):
    argv = [
        "step-plan",
        "rag",
        "--tiny",
        "--max-num-seqs",
        "4,16",
        "--max-num-batched-tokens",
        "64",
    ]
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "rag-tiny: the scheduler's steps (model stubbed)" in out
    assert len([line for line in out.splitlines() if line.startswith(("4 ", "16 "))]) == 2
