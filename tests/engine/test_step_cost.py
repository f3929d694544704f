"""The step cost model: fitted from synthetic step times whose true cost is known."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.step_cost import (
    GROWTH,
    MIN_CHUNK,
    PROBE_TOKENS,
    StepCostModel,
    StepShape,
    chunk_pairs,
    nonnegative_least_squares,
)

PLAIN = 2e-3  # seconds of a plain decode step
C = 15000  # break-even context (Llama-3.2-1B: 14,848): a token at 15k context costs 2 by FLOPs


def true_extra(n: int, context: int, e=1e-3, a=4e-6, b=8e-6) -> float:
    """A mixed step's time over a plain one: fixed cost, per token, per attention pair."""
    return e + a * n + b * chunk_pairs(n, context) / C


def mixed(n: int, context: int, decodes: int = 8) -> StepShape:
    return StepShape(decodes, n, chunk_pairs(n, context), n)


def plain(decodes: int = 8) -> StepShape:
    return StepShape(decodes, 0, 0)


def trained(ratio=2.5, noise=0.0, seed=0, **cost) -> StepCostModel:
    """A model that has seen plain steps and mixed steps through a 30k prompt."""
    rng = random.Random(seed)
    model = StepCostModel(ratio, C)
    for _ in range(5):
        model.observe(plain(), PLAIN)
    context = 0
    for n in [64, 128, 256, 200, 150, 120, 100, 90, 80, 70, 60, 60, 50, 50, 40, 40]:
        t = PLAIN + true_extra(n, context, **cost) * (1 + noise * rng.uniform(-1, 1))
        model.observe(mixed(n, context), t)
        context += n * 20  # every step a little deeper, to ~30k
    return model


def test_least_squares_recovers_exact_coefficients():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(20), rng.uniform(10, 500, 20), rng.uniform(0, 900, 20)])
    y = x @ np.array([1e-3, 4e-6, 8e-6])
    np.testing.assert_allclose(nonnegative_least_squares(x.T @ x, x.T @ y), [1e-3, 4e-6, 8e-6])


def test_least_squares_keeps_every_coefficient_non_negative():
    """Times that fall with the attention feature would fit a negative b: it is held at 0
    and the rest refitted (the best non-negative answer, not the unconstrained one clipped)."""
    rng = np.random.default_rng(1)
    x = np.column_stack([np.ones(30), rng.uniform(10, 500, 30), rng.uniform(0, 900, 30)])
    y = 1e-3 + 5e-6 * x[:, 1] - 1e-6 * x[:, 2]
    e, a, b = nonnegative_least_squares(x.T @ x, x.T @ y)
    assert b == 0.0 and a > 0 and e > 0
    two = x[:, :2]
    np.testing.assert_allclose([e, a], np.linalg.lstsq(two, y, rcond=None)[0])


def test_one_chunk_size_alone_is_put_down_to_one_coefficient():
    """Every chunk the same size and context: a fixed cost and a per-token cost fit equally
    well, and the solve takes the one-coefficient answer rather than an arbitrary split."""
    x = np.array([[1.0, 64.0, 2.08]] * 3)
    y = np.full(3, 1e-3)
    theta = nonnegative_least_squares(x.T @ x, x.T @ y)
    assert np.count_nonzero(theta) == 1
    np.testing.assert_allclose(x @ theta, y)


def test_no_cap_before_a_plain_step_then_a_probe_before_a_mixed_one():
    model = StepCostModel(2.5, C)
    assert model.chunk_cap(0) is None  # nothing timed: the token cap decides
    model.observe(mixed(100, 0), 0.01)  # a mixed step without a plain one to compare with
    assert model.num_mixed == 0 and model.chunk_cap(0) is None
    model.observe(plain(), PLAIN)
    assert model.chunk_cap(0) == PROBE_TOKENS


@pytest.mark.parametrize("context", [0, 1000, 8000, 30000])
def test_chunks_fill_the_budget_at_every_context(context):
    """With exact times the cap is the largest chunk whose true step time is within
    ratio x plain step (to the 1% the prior toward a == b costs), at the start of a prompt as
    deep inside it."""
    model = trained()
    model.largest_measured = 10**6  # the growth limit is tested on its own
    n = model.chunk_cap(context)
    budget = (2.5 - 1) * PLAIN
    assert true_extra(n, context) <= 1.01 * budget < 1.02 * true_extra(n + 1, context)
    assert model.coefficients() == pytest.approx((1e-3, 4e-6, 8e-6), rel=1e-2)


def test_noisy_times_still_keep_chunks_near_the_budget():
    model = trained(noise=0.15, seed=3)
    model.largest_measured = 10**6
    budget = (2.5 - 1) * PLAIN
    for context in (2000, 16000, 32000):
        n = model.chunk_cap(context)
        assert 0.7 * budget <= true_extra(n, context) <= 1.3 * budget


def test_deeper_chunks_are_shorter():
    model = trained()
    caps = [model.chunk_cap(x) for x in (0, 2000, 8000, 32000)]
    assert caps == sorted(caps, reverse=True) and caps[0] > 2 * caps[-1]


def test_attention_slower_than_its_flops_makes_deep_chunks_shorter_still():
    """The fit finds b from the times: attention at a quarter of the matmuls' FLOP rate (b = 4a)
    cuts a chunk at 32k to well under what a == b would allow."""
    even = trained(a=4e-6, b=4e-6)
    slow = trained(a=4e-6, b=16e-6)
    for m in (even, slow):
        m.largest_measured = 10**6
    assert slow.chunk_cap(32000) < 0.6 * even.chunk_cap(32000)
    assert slow.coefficients()[2] == pytest.approx(16e-6, rel=1e-2)


def test_a_chunk_grows_at_most_by_growth_over_the_largest_measured():
    model = StepCostModel(2.5, C)
    model.observe(plain(), PLAIN)
    model.observe(mixed(PROBE_TOKENS, 0), PLAIN + 1e-5)  # the probe cost almost nothing
    assert model.chunk_cap(0) == GROWTH * PROBE_TOKENS
    model.observe(mixed(GROWTH * PROBE_TOKENS, 64), PLAIN + 2e-5)
    assert model.chunk_cap(0) == GROWTH * GROWTH * PROBE_TOKENS


def test_a_fixed_cost_over_the_budget_leaves_the_token_cap(caplog):
    """If a mixed step costs more than the budget before any token, no chunk size meets the
    ratio: cutting the prompt finer would only make its prefill slower. Said once."""
    model = StepCostModel(1.5, C)
    model.observe(plain(), PLAIN)
    for n, context in [(64, 0), (128, 64), (100, 192), (80, 292)]:
        model.observe(mixed(n, context), PLAIN + true_extra(n, context, e=5e-3))
    with caplog.at_level("WARNING", logger="engine.step_cost"):
        assert model.chunk_cap(400) is None and model.chunk_cap(500) is None
    assert [r.message for r in caplog.records if "5.00 ms more" in r.message] != []
    assert len(caplog.records) == 1
    assert model.describe()["fixed_s"] == pytest.approx(5e-3, rel=1e-2)


def test_a_small_budget_still_moves_the_prompt():
    model = trained(ratio=1.55)  # 0.1 ms left after the fixed cost: 5 tokens at 30k
    assert model.chunk_cap(30000) == MIN_CHUNK


def test_one_slow_plain_step_does_not_move_the_budget():
    model = trained()
    before = model.chunk_cap(1000)
    model.observe(plain(), 10 * PLAIN)  # e.g. the first step at a new shape
    assert model.plain_seconds == PLAIN and model.chunk_cap(1000) == before


def test_the_ratio_must_leave_room_for_a_chunk():
    with pytest.raises(ValueError, match="must be > 1"):
        StepCostModel(1.0, C)


# -- in the engine: steps timed on the CPU, the tiny model -----------------------------------


def run_long_prefill(path, ratio: float):
    """Four decoders, then a 300-token prompt while they decode; each step's chunks."""
    from engine import LLM, SamplingParams

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
        steps.append([(c.seq.request_id, c.num_new_tokens) for c in out.chunks])
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
    chunks = [n for step in steps for rid, n in step if rid == "long" and n > 1]
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


def test_steps_are_timed_only_when_asked(tiny_models):
    from engine import LLM

    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64)
    assert llm.engine.step_cost is None  # the CPU's default: chunks by the token cap alone
    assert llm.engine.scheduler.config.long_prefill_step_ratio == 0


@pytest.mark.parametrize("ratio", [1.0, 0.5, -2.0])
def test_a_ratio_that_leaves_no_room_is_refused(ratio):
    from engine.config import SchedulerConfig

    with pytest.raises(ValueError, match="long_prefill_step_ratio must be > 1"):
        SchedulerConfig(long_prefill_step_ratio=ratio)
    SchedulerConfig(long_prefill_step_ratio=0)  # off
