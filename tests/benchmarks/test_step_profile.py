"""StepProfile splits every engine step into phases that add up to the step."""

from __future__ import annotations

import time

from benchmarks.models import TINY_LLAMA, random_model_dir
from benchmarks.step_profile import PHASES, StepProfile
from engine import LLM, SamplingParams


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
    summary = profile.summary()
    assert summary["steps"] == len(profile.steps) and summary["graph_steps"] == 0
    assert summary["host_seconds"] < elapsed
    profile.clear()
    assert profile.summary()["steps"] == 0
