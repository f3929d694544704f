"""The step cost model: a feedback loop on simulated steps whose true cost is known."""

from __future__ import annotations

import random

import pytest

from kvbatch.engine import SamplingParams
from kvbatch.engine.exec.cuda_graphs import CHUNK_BUCKETS
from kvbatch.engine.sched.step_cost import (
    GROWTH,
    MIN_CHUNK,
    OUT_OF_REACH_STEPS,
    PROBE_TOKENS,
    StepCostModel,
    StepShape,
    chunk_pairs,
)
from tests.engine.sched.simulated_prefill import DOUBLING, padded, simulate_prefill

PLAIN = 2e-3  # seconds of a plain decode step
C = 15000  # break-even context (Llama-3.2-1B: 14,848): a token at 15k context costs 2 by FLOPs
BUDGET = (2.5 - 1) * PLAIN
TOKEN_CAP = 512  # the scheduler's cap when the model has none


def true_extra(n: int, context: int, e=5e-4, a=4e-6, b=8e-6) -> float:
    """A mixed step's time over a plain one: fixed cost, per token, per attention pair (here
    attention at half its FLOP rate: b = 2a)."""
    return e + a * n + b * chunk_pairs(n, context) / C


def mixed(n: int, context: int, decodes: int = 8) -> StepShape:
    return StepShape(decodes, n, chunk_pairs(n, context), n)


def plain(decodes: int = 8) -> StepShape:
    return StepShape(decodes, 0, 0)


def prefill(model, prompt_len=32768, noise=0.0, seed=0, **cost) -> list[tuple[int, int, float]]:
    """Simulate a long prompt's prefill, every chunk sized by the model and timed: (chunk,
    context, step time over a plain one) per step."""
    rng = random.Random(seed)
    steps, context = [], 0
    while context < prompt_len:
        cap = model.chunk_cap(context)
        n = min(TOKEN_CAP if cap is None else cap, prompt_len - context)
        extra = true_extra(n, context, **cost) * (1 + noise * rng.uniform(-1, 1))
        model.observe(mixed(n, context), PLAIN + extra)
        steps.append((n, context, extra))
        context += n
    return steps


def timed_model(ratio=2.5) -> StepCostModel:
    model = StepCostModel(ratio, C)
    for _ in range(5):
        model.observe(plain(), PLAIN)
    return model


def test_no_cap_before_a_plain_step_then_a_probe_before_a_mixed_one():
    model = StepCostModel(2.5, C)
    assert model.chunk_cap(0) is None  # nothing timed: the token cap decides
    model.observe(mixed(100, 0), 0.01)  # a mixed step without a plain one to compare with
    assert model.num_mixed == 0 and model.chunk_cap(0) is None
    model.observe(plain(), PLAIN)
    assert model.chunk_cap(0) == PROBE_TOKENS


def test_a_32k_prefill_settles_on_the_budget_and_follows_the_context():
    """From the probe the chunks grow (at most 2x a step) until a step costs the budget, then
    shrink as the context deepens, every step near the budget after the first few: the loop
    needs neither the fixed cost nor attention's true rate."""
    steps = prefill(timed_model())
    chunks = [n for n, _, _ in steps]
    assert chunks[0] == PROBE_TOKENS
    for i in range(1, len(chunks) - 1):
        assert chunks[i] <= GROWTH * max(chunks[:i])
    settled = [extra for _, _, extra in steps[8:-1]]
    assert max(settled) <= 1.1 * BUDGET and min(settled) >= 0.85 * BUDGET
    assert max(chunks) > 3 * chunks[-2]  # deep chunks are much shorter than early ones


@pytest.mark.parametrize("fixed", [0.0, 1e-3, 2.5e-3])
def test_any_fixed_cost_under_the_budget_is_absorbed(fixed):
    steps = prefill(timed_model(), prompt_len=8192, e=fixed)
    late = [extra for _, _, extra in steps[10:-1]]
    assert max(late) <= 1.1 * BUDGET and min(late) >= 0.85 * BUDGET


def test_noisy_steps_stay_near_the_budget():
    steps = prefill(timed_model(), noise=0.2, seed=3)
    late = [true_extra(n, x) for n, x, _ in steps[8:-1]]  # the noise-free cost of each chunk
    assert max(late) <= 1.5 * BUDGET and sorted(late)[len(late) // 2] >= 0.7 * BUDGET


def test_one_slow_step_shrinks_the_next_chunks_then_they_recover():
    model = timed_model()
    prefill(model, prompt_len=4000)
    before = model.chunk_cap(4000)
    model.observe(mixed(before, 4000), PLAIN + 20 * BUDGET)  # the machine stalled once
    assert model.chunk_cap(4000 + before) < before / 2
    context = 4000 + before
    for _ in range(6):
        n = model.chunk_cap(context)
        model.observe(mixed(n, context), PLAIN + true_extra(n, context))
        context += n
    assert model.chunk_cap(context) >= 0.75 * before


def test_a_fixed_cost_over_the_budget_gives_the_token_cap_back(caplog):
    """No chunk size fits when a mixed step costs more than the budget before any token:
    after a few floor-sized chunks over budget the model says so, once, and steps aside."""
    model = timed_model()
    with caplog.at_level("WARNING", logger="kvbatch.engine.sched.step_cost"):
        steps = prefill(model, prompt_len=2000, e=2 * BUDGET)
    assert model.out_of_reach and model.chunk_cap(5000) is None
    floor_steps = [n for n, _, _ in steps if n == MIN_CHUNK]
    assert len(floor_steps) >= OUT_OF_REACH_STEPS
    assert len([r for r in caplog.records if "no chunk size" in r.message]) == 1
    assert caplog.records[0].getMessage().endswith("so long prompts keep the token cap")
    assert model.describe()["out_of_reach"] is True


def test_out_of_reach_chunks_stay_within_the_graphs_last_bucket(caplog):
    """With graphs the token cap still holds, but never past the last bucket: a larger
    chunk would run eagerly (H200, ratio 1.5: one decoder waited 868 ms on such steps)."""
    model = timed_model()
    model.chunk_buckets = lambda: [16, 32, 64, 128, 256]  # under the token cap (512)
    with caplog.at_level("WARNING", logger="kvbatch.engine.sched.step_cost"):
        steps = prefill(model, prompt_len=8000, e=2 * BUDGET)
    assert "keep the token cap (at most 256 tokens: the last CUDA-graph chunk)" in caplog.text
    assert model.out_of_reach and model.chunk_cap(5000) == 256
    after = [n for n, _, _ in steps[[n for n, _, _ in steps].index(MIN_CHUNK) :]]
    after = after[OUT_OF_REACH_STEPS:]  # from the step after the model gave up
    assert len(after) > 10 and set(after[:-1]) == {256} and after[-1] <= 256
    model.chunk_buckets = lambda: []  # a failed capture: no graphs, the token cap alone
    assert model.chunk_cap(5000) is None


def test_one_floor_chunk_over_budget_is_not_out_of_reach():
    model = timed_model(ratio=1.2)  # a small budget: the chunks reach the floor
    budget = model.budget
    model.observe(mixed(MIN_CHUNK, 30000), PLAIN + 2 * budget)
    model.observe(mixed(MIN_CHUNK, 30016), PLAIN + 0.5 * budget)
    model.observe(mixed(MIN_CHUNK, 30032), PLAIN + 2 * budget)
    assert not model.out_of_reach and model.chunk_cap(30048) == MIN_CHUNK


def test_chunks_that_cost_nothing_grow_by_the_growth_limit():
    model = timed_model()
    model.observe(mixed(PROBE_TOKENS, 0), PLAIN - 1e-4)  # faster than a plain step: noise
    assert model.chunk_cap(0) == GROWTH * PROBE_TOKENS


def test_one_slow_plain_step_does_not_move_the_budget():
    model = timed_model()
    prefill(model, prompt_len=2000)
    before = model.chunk_cap(2000)
    model.observe(plain(), 10 * PLAIN)  # e.g. the first step at a new shape
    assert model.plain_seconds == PLAIN and model.chunk_cap(2000) == before


def test_without_a_break_even_context_work_is_tokens():
    model = StepCostModel(2.5, 0)
    model.observe(plain(), PLAIN)
    model.observe(mixed(100, 5000), PLAIN + 100 * 1e-5)  # 10 us a token
    assert model.chunk_cap(20000) == min(int(BUDGET / 1e-5), GROWTH * 100)


BUCKETS = list(CHUNK_BUCKETS)


@pytest.mark.parametrize("per_token", [4e-6, 8e-6])
def test_padded_chunks_are_sized_by_their_buckets_and_stay_within_the_budget(per_token):
    """A graph pads a chunk to its bucket. Sized by its real tokens, a 300-token chunk costs
    512 rows, the loop swings between buckets and steps run over the budget (checked here, as
    the reason); sized against the buckets, every step stays within it. With doubling buckets
    the chunks that just miss one leave much of the budget unused; 1.5x steps use most of it.
    (docs/archive/BENCHMARKS-history.md has the same simulation over more cases.)"""
    blind = simulate_prefill(timed_model(), PLAIN, per_token, 5e-4, DOUBLING, charge_rows=False)
    assert max(extra for _, _, extra in blind[8:-1]) > 1.2 * BUDGET
    for buckets, least_mean in ((DOUBLING, 0.8), (BUCKETS, 0.95)):
        model = timed_model()
        model.chunk_buckets = lambda buckets=buckets: buckets
        steps = simulate_prefill(model, PLAIN, per_token, 5e-4, buckets, charge_rows=True)
        settled = [extra for _, _, extra in steps[8:-1]]
        assert max(settled) <= 1.01 * BUDGET
        assert sum(settled) / len(settled) >= least_mean * BUDGET
    assert len(steps) <= len(blind)


def test_a_chunk_cap_never_pays_for_more_padding_than_the_budget():
    """Against every context and budget: the cap's bucket plus its attention fits the work the
    budget buys, and one token more would not (the cap is the largest that fits), up to the
    last bucket."""
    model = timed_model()
    model.chunk_buckets = lambda: BUCKETS
    model.observe(mixed(64, 0), PLAIN + 64 * 1e-5)  # cost per work: 1e-5 s
    model.largest_measured = 10_000  # the growth guard out of the way
    for context in (0, 1000, 8000, 20000, 32000):
        for budget_work in (20, 50, 100, 150, 300, 600, 900):
            model.cost_per_work = BUDGET / budget_work
            n = model.chunk_cap(context)
            work = padded(n, BUCKETS) + chunk_pairs(n, context) / C
            assert work <= budget_work + 1e-6 or n == MIN_CHUNK
            if MIN_CHUNK < n < BUCKETS[-1]:  # the last bucket is as far as a chunk goes
                assert padded(n + 1, BUCKETS) + chunk_pairs(n + 1, context) / C > budget_work
    model.cost_per_work = BUDGET / 900
    assert model.chunk_cap(0) == 512  # past the last bucket a step would run eagerly
    model.chunk_buckets = lambda: []  # no mixed graphs: every step eager, nothing padded
    assert model.chunk_cap(0) > 800


def test_padded_rows_are_the_work_a_step_is_charged_for():
    model = timed_model()
    model.observe(StepShape(8, 40, chunk_pairs(40, 0), 40, prefill_rows=64), PLAIN + 64e-5)
    assert model.cost_per_work == pytest.approx(64e-5 / (64 + chunk_pairs(40, 0) / C))


def test_the_buckets_are_asked_afresh():
    buckets = [16, 32, 64, 128, 256, 512]
    model = timed_model()
    model.chunk_buckets = lambda: buckets
    model.observe(mixed(64, 0), PLAIN + 64 * 1e-5)
    model.largest_measured = 10_000
    model.cost_per_work = BUDGET / 200  # 200 tokens' worth: the 128 bucket, or 199 unpadded
    assert model.chunk_cap(100) == 128
    buckets.clear()  # a failed capture: mixed steps run eagerly, unpadded
    assert model.chunk_cap(100) > 190


def test_the_ratio_must_leave_room_for_a_chunk():
    with pytest.raises(ValueError, match="must be > 1"):
        StepCostModel(1.0, C)


# -- in the engine: steps timed on the CPU, the tiny model -----------------------------------


def run_long_prefill(path, ratio: float):
    """Four decoders, then a 300-token prompt while they decode; each step's chunks."""
    from kvbatch.engine import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        device="cpu",
        num_kv_blocks=128,
        max_model_len=512,
        long_prefill_token_threshold=128,
        long_prefill_step_ratio=ratio,
    )
    engine = llm.engine
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(
            [
                (c.seq.request_id, c.num_new_tokens)
                for c in out.chunks
                if c.seq.num_computed_tokens < c.seq.num_prompt_tokens  # prompt chunks only
            ]
        )
        return out

    engine.scheduler.schedule = recording
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 17, 3 + i] for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy, request_id=f"d{i}")
    outs = []
    for _ in range(4):
        outs += engine.step()
    long = [(7 * i) % 500 + 3 for i in range(300)]
    engine.add_request(long, SamplingParams(max_tokens=2, temperature=0.0), request_id="long")
    while engine.has_unfinished():
        outs += engine.step()
    # (told apart from decodes by the prompt, not by `n > 1`: timed chunks can leave one token)
    chunks = [n for step in steps for rid, n in step if rid == "long"]
    tokens = {o.request_id: o.outputs[0].token_ids for o in outs}
    return engine, chunks, tokens


def test_the_engine_times_its_steps_and_grows_a_long_prompts_chunks(tiny_models):
    path = tiny_models("llama-gqa")
    timed, chunks, tokens = run_long_prefill(path, ratio=2.5)
    cost = timed.step_cost
    assert cost is not None and cost.plain_seconds > 0 and cost.num_mixed >= 1
    assert sum(chunks) == 300 and chunks[0] == PROBE_TOKENS
    for i in range(1, len(chunks) - 1):  # the last chunk is whatever is left
        assert MIN_CHUNK <= chunks[i] <= GROWTH * max(chunks[:i])
    plain, plain_chunks, plain_tokens = run_long_prefill(path, ratio=0)
    assert plain.step_cost is None and plain_chunks[0] > PROBE_TOKENS
    assert tokens == plain_tokens  # chunking changes when tokens are computed, not which


def test_steps_through_a_graph_are_charged_for_their_chunk_bucket(tiny_models):
    """With mixed-step graphs (their static buffers, eager on the CPU: the triton backend under
    the interpreter) the cost model sizes chunks against the runner's buckets, and a step that
    ran a prompt's chunk beside a decode reports the rows of its chunk's bucket."""
    from kvbatch.engine import LLM

    llm = LLM(
        model=str(tiny_models("llama-gqa")),
        device="cpu",
        attention_backend="triton",
        num_kv_blocks=32,
        max_model_len=128,
        long_prefill_token_threshold=32,
        long_prefill_step_ratio=2.5,
    )
    engine = llm.engine
    cost = engine.step_cost
    assert list(cost.chunk_buckets()) == []  # no graphs yet: chunks are not padded
    engine.runner.capture_step_graphs(4, 128, max_chunk=64, capture=False)
    assert list(cost.chunk_buckets()) == [16, 32, 48, 64]
    shapes = []
    observe = cost.observe
    cost.observe = lambda shape, seconds: (shapes.append(shape), observe(shape, seconds))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 9, 17, 3], greedy, request_id="d")
    for _ in range(3):  # its prompt, then plain steps: the cost model's reference
        engine.step()
    engine.add_request(list(range(3, 43)), greedy, request_id="p")  # cut by the token cap
    while engine.has_unfinished():
        engine.step()
    mixed_shapes = [s for s in shapes if s.is_mixed]  # the prompt's chunks beside the decode
    assert sum(s.prefill_tokens for s in mixed_shapes) == 40 and cost.num_mixed >= 1
    for s in mixed_shapes:
        assert s.prefill_rows == padded(s.prefill_tokens, [16, 32, 48, 64]) > s.prefill_tokens


def test_steps_are_timed_only_when_asked(tiny_models):
    from kvbatch.engine import LLM

    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64)
    assert llm.engine.step_cost is None  # the CPU's default: chunks by the token cap alone
    assert llm.engine.scheduler.config.long_prefill_step_ratio == 0


@pytest.mark.parametrize("ratio", [1.0, 0.5, -2.0])
def test_a_ratio_that_leaves_no_room_is_refused(ratio):
    from kvbatch.engine.core.config import SchedulerConfig

    with pytest.raises(ValueError, match="long_prefill_step_ratio must be > 1"):
        SchedulerConfig(long_prefill_step_ratio=ratio)
    SchedulerConfig(long_prefill_step_ratio=0)  # off
