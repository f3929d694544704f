"""StepProfile splits every engine step into phases that add up to the step."""

from __future__ import annotations

import gc
import time

from kvbatch.bench.models import TINY_LLAMA, random_model_dir
from kvbatch.bench.step_profile import PHASES, StepProfile, format_step_profile, graph_label
from kvbatch.engine import LLM, SamplingParams
from tests.engine.exec.test_cuda_graphs import simulate_graph_captures


def test_phases_of_every_step_that_ran_the_model(tmp_path):
    llm = LLM(str(random_model_dir(TINY_LLAMA, tmp_path)), max_num_batched_tokens=32)
    engine = llm.engine
    profile = StepProfile(engine)
    start = time.perf_counter()
    prompts = [[5 + i] * 40 for i in range(3)]  # 120 prompt tokens: chunked over 4+ steps
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(profile.steps) == engine._num_steps >= 4 + 3
    for step in profile.steps:
        assert set(step) == set(PHASES) and all(v >= 0 for v in step.values())
    assert sum(sum(s.values()) for s in profile.steps) <= elapsed
    # the last step in detail: its phases in ms, no graph; the CPU's steps are not timed
    # (the engine times them for timed chunks, off on the CPU by default)
    last = profile.last
    assert last is not None and last["graph"] is None and last["collected_device_ms"] is None
    assert [last[f"{k}_ms"] for k in PHASES] == [
        round(profile.steps[-1][k] * 1e3, 3) for k in PHASES
    ]
    summary = profile.summary()
    assert summary["steps"] == len(profile.steps) and summary["graph_steps"] == 0
    assert summary["host_seconds"] < elapsed
    gc.collect()  # a full pass while the profile watches: counted, and named in its line
    summary = profile.summary()
    assert summary["gc"]["full_passes"] >= 1 and summary["gc"]["longest_full_pass_s"] > 0
    assert "; GC: " in format_step_profile(summary)
    profile.clear()
    assert profile.summary()["steps"] == 0
    assert profile.summary()["gc"]["collections"] == [0, 0, 0]


def test_graph_steps_with_a_chunk_and_their_captures_are_counted(tmp_path):
    """The static-buffer graph path (eager on the CPU, the Triton interpreter): decode steps
    beside a chunked prompt count as graph steps with a chunk, and a capture on the first use
    of a pair of buckets (simulated: CUDA captures) is counted once per pair."""
    path = str(random_model_dir(TINY_LLAMA, tmp_path))
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=32, max_model_len=128)
    engine = llm.engine
    engine.runner.capture_step_graphs(max_batch=4, max_model_len=128, max_chunk=32, capture=False)
    first_seen = set()
    simulate_graph_captures(engine.runner.step_graphs, first_seen)
    profile = StepProfile(engine)
    prompts = [[5] * 10, list(range(3, 103))]  # the second one in chunks beside the first's decodes
    labels = []
    engine_step = engine.step

    def step():
        done = engine_step()
        labels.append(profile.last and profile.last["graph"])
        return done

    engine.step = step
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    # each step's graph in words: decode buckets alone, and with the chunk's bucket
    assert "1 decodes + a 32-token chunk" in labels and "2 decodes" in labels
    summary = profile.summary()
    assert (
        summary["mixed_graph_steps"] >= 3 and summary["graph_steps"] > summary["mixed_graph_steps"]
    )
    assert summary["graph_captures"] == len(first_seen) >= 1
    assert summary["graph_first_launches"] == 0  # nothing replays a graph on the CPU
    assert "captured in the run, 0 launched for the first time" in format_step_profile(summary)


def test_graph_labels_name_the_bucket_chunk_tables_and_groups():
    from kvbatch.engine.exec.cuda_graphs import GraphKey

    assert graph_label(GraphKey(64, False)) == "64 decodes"
    assert graph_label(GraphKey(72, True, 32, True)) == (
        "72 decodes + a 32-token chunk, wide tables, shared-prefix groups"
    )
    assert graph_label(GraphKey(64, False, 48), first_launch=True) == (
        "64 decodes + a 48-token chunk, its first launch"
    )
