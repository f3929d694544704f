"""Scheduler policy on a real KV cache manager, without a model (milliseconds)."""

from __future__ import annotations

import random

from kvbatch.engine.core.config import SchedulerConfig
from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import Sequence, SequenceStatus
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.sched.scheduler import Scheduler
from kvbatch.engine.sched.step_cost import PROBE_TOKENS, StepCostModel, StepShape, chunk_pairs


def make_seq(name: str, n: int, max_tokens: int = 4, base: int = 0) -> Sequence:
    return Sequence(name, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler, new_token: int = 7):
    """One step without a model: advance, append a token where the chunk samples, finish."""
    out = sched.schedule()
    sampled = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    done = []
    for seq in sampled:
        seq.token_ids.append(new_token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            done.append(seq)
    sched.finish(done)
    sched.kv.check_integrity()
    return out


def scheduler(blocks=64, block_size=4, seqs=8, budget=64, caching=True) -> Scheduler:
    kv = KVCacheManager(blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget), kv)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sched = scheduler(budget=8)
    seq = make_seq("a", 20, max_tokens=2)
    sched.add(seq)
    sizes = [run_step(sched).chunks[0].num_new_tokens for _ in range(3)]
    assert sizes == [8, 8, 4]
    assert seq.num_output_tokens == 1  # sampled only when the last chunk reached the end


def test_decodes_come_before_prefill_chunks_and_fit_the_budget():
    sched = scheduler(budget=10)
    a, b = make_seq("a", 3, max_tokens=10), make_seq("b", 30, max_tokens=10, base=100)
    sched.add(a)
    run_step(sched)  # a prefilled
    sched.add(b)
    out = run_step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    assert out.num_tokens <= 10


def test_admission_follows_the_given_order_and_the_sequence_cap():
    sched = scheduler(seqs=2)
    seqs = [make_seq(str(i), 5, base=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["0", "1"]
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2


def test_prefix_hit_is_reused_at_admission():
    sched = scheduler(block_size=4)
    first = make_seq("a", 13)
    sched.add(first)
    run_step(sched)
    second = Sequence("b", list(range(12)) + [99], SamplingParams(max_tokens=4))
    sched.add(second)
    out = run_step(sched)
    chunk = next(c for c in out.chunks if c.seq is second)
    assert second.num_cached_tokens == 12 and chunk.num_new_tokens == 1


def test_newest_sequence_is_preempted_and_recomputed_first():
    # 6 blocks of 4 tokens; three prompts of 7 tokens need 2 blocks each; growing needs more.
    sched = scheduler(blocks=6, block_size=4, caching=False)
    seqs = [make_seq(str(i), 7, max_tokens=6, base=20 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    run_step(sched)  # each reaches 8 tokens: blocks still suffice
    out = run_step(sched)  # each needs a third block: the newest is preempted
    assert out.num_preempted >= 1
    assert seqs[2].status is SequenceStatus.WAITING and sched.waiting[0] is seqs[2]
    assert seqs[2].num_computed_tokens == 0
    for _ in range(40):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert sched.kv.num_free_blocks == 6


def test_no_request_starves_under_random_pressure():
    rng = random.Random(0)
    sched = scheduler(blocks=24, block_size=4, seqs=6, budget=16)
    seqs = [
        make_seq(
            str(i),
            rng.randint(1, 30),
            max_tokens=rng.randint(1, 12),
            base=rng.choice([0, 0, 1000 * i]),
        )
        for i in range(30)
    ]
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        assert out.chunks, "a step scheduled nothing while requests were pending"
        assert out.num_tokens <= 16 and len(sched.running) <= 6
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.kv.num_free_blocks == 24


def test_long_prompt_chunks_shrink_as_attention_over_their_context_grows():
    """With attention_break_even_context c, a token at context x costs (1 + x / c) tokens'
    worth: a chunk of n after x costs n * (1 + (x + n / 2) / c), at most the cap's 16."""
    kv = KVCacheManager(256, 4, True)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
        attention_break_even_context=32,
    )
    sched = Scheduler(config, kv)
    decoder = make_seq("decoder", 5, max_tokens=200)
    sched.add(decoder)
    run_step(sched)
    long = make_seq("long", 300, max_tokens=1, base=2000)
    sched.add(long)
    contexts, chunks = [], []
    while long.num_computed_tokens < 200:
        contexts.append(long.num_computed_tokens)
        step = run_step(sched)
        chunks.append(next(c.num_new_tokens for c in step.chunks if c.seq is long))

    def cost(n: int, x: int) -> float:
        return n * (1 + (x + n / 2) / 32)

    for n, x in zip(chunks, contexts):  # the largest chunk within the cap (1 at least)
        assert n == 1 or cost(n, x) <= 16 < cost(n + 1, x)
    assert chunks[0] == 13 and chunks[-1] < 3
    # alone, the prompt still takes the whole budget
    sched.abort(decoder)
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [64]


def test_a_long_prompt_is_cut_into_short_chunks_while_others_decode():
    """long_prefill_token_threshold: with decodes in the step, a prompt's chunk is capped;
    alone, it takes the whole budget."""
    kv = KVCacheManager(256, 4, True)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    sched = Scheduler(config, kv)
    long_alone = make_seq("alone", 100, max_tokens=1, base=1000)
    sched.add(long_alone)
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [64]
    while sched.has_unfinished():
        run_step(sched)

    decoder = make_seq("decoder", 5, max_tokens=50)
    sched.add(decoder)
    run_step(sched)  # its prompt; from now on it decodes
    sched.add(make_seq("long", 100, max_tokens=1, base=2000))
    steps = [run_step(sched) for _ in range(3)]
    assert [[c.num_new_tokens for c in s.chunks] for s in steps] == [[1, 16]] * 3


def test_a_long_prompts_chunk_follows_the_step_cost_model():
    """With a step cost model, a prompt longer than the threshold is cut to what keeps the step
    within its ratio of a plain step (first a probe, then the fit); a prompt within the
    threshold is not cut for time; alone, the long prompt takes the whole budget."""
    kv = KVCacheManager(512, 4, True)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=128,
        attention_break_even_context=0,  # tokens only: the model's cap is budget / a
    )
    cost = StepCostModel(2.5, 0)
    sched = Scheduler(config, kv, cost)
    decoder = make_seq("decoder", 5, max_tokens=200)
    sched.add(decoder)
    assert run_step(sched).shape == StepShape(0, 5, chunk_pairs(5, 0), 5)  # its prompt
    plain = run_step(sched)
    assert plain.shape == StepShape(1, 0, 0, 0) and plain.shape.is_plain
    cost.observe(plain.shape, 1e-3)

    sched.add(make_seq("long", 400, max_tokens=1, base=1000))
    sched.add(make_seq("short", 100, max_tokens=1, base=5000))
    probe = run_step(sched)
    assert [c.num_new_tokens for c in probe.chunks] == [1, PROBE_TOKENS, 100]
    assert probe.shape == StepShape(
        1, PROBE_TOKENS + 100, chunk_pairs(PROBE_TOKENS, 0) + chunk_pairs(100, 0), 100
    )
    # two timed chunks: 20 us a token, no fixed cost -> 1.5 ms of budget is 75 tokens
    for n in (50, 100):
        cost.observe(StepShape(1, n, chunk_pairs(n, 0), n), 1e-3 + n * 2e-5)
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [1, 75]
    sched.abort(decoder)
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [256]  # the step budget


# -- async scheduling: tokens still on the device (Sequence.num_pending) ---------------------


def launch_step(sched: Scheduler):
    """Schedule and queue a step without a model: its sampled tokens become pending."""
    out = sched.schedule()
    sampled = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    for seq in sampled:
        seq.num_pending += 1
    return out


def land_token(sched: Scheduler, seq: Sequence, token: int = 7) -> bool:
    """A pending token reaches the host; True (and finished) when it was the last."""
    seq.num_pending -= 1
    seq.token_ids.append(token)
    if seq.num_output_tokens >= seq.params.max_tokens:
        sched.finish([seq])
        return True
    return False


def test_a_pending_token_is_decoded_next():
    sched = scheduler()
    seq = make_seq("a", 6, max_tokens=3)
    sched.add(seq)
    launch_step(sched)  # prefill; first token pending
    out = launch_step(sched)  # its decode is queued before the token lands
    assert [(c.seq, c.num_new_tokens, c.samples) for c in out.chunks] == [(seq, 1, True)]
    assert seq.num_pending == 2 and seq.num_computed_tokens == 7


def test_a_request_ending_with_its_pending_token_frees_its_place_and_blocks():
    sched = scheduler(seqs=1, blocks=4, block_size=4)  # one place, 16 token slots
    a, b = make_seq("a", 6, max_tokens=1), make_seq("b", 8, max_tokens=1, base=50)
    sched.add(a)
    sched.add(b)
    launch_step(sched)  # a prefilled: its only token is pending
    assert sched.kv.num_free_blocks == 2
    out = launch_step(sched)  # a is not decoded again; b takes its place and its blocks
    assert [c.seq for c in out.chunks] == [b]
    assert a.status is SequenceStatus.RUNNING and a.num_pending == 1
    assert sched.kv.num_free_blocks == 2  # a's two blocks went back, b took two
    assert land_token(sched, a)
    assert sched.running == [b]
    sched.kv.check_integrity()


def test_a_request_preempted_with_a_pending_token_waits_for_it():
    sched = scheduler(blocks=4, block_size=4, seqs=4, budget=64)
    a, b = make_seq("a", 8, max_tokens=8), make_seq("b", 7, max_tokens=8, base=50)
    sched.add(a)
    sched.add(b)
    launch_step(sched)  # both prefilled (2 blocks each): the pool is full
    out = launch_step(sched)  # a's next token needs a block, none is free: b (newest) goes
    assert out.num_preempted == 1 and b.status is SequenceStatus.WAITING
    assert b.num_pending == 1 and list(sched.waiting) == [b]
    assert land_token(sched, a) is False
    sched.finish([a])  # room again, but b's token is still in flight: nothing is admitted
    assert launch_step(sched).chunks == []
    assert land_token(sched, b) is False
    out = launch_step(sched)  # now b is recomputed, its landed token included
    assert [c.seq for c in out.chunks] == [b] and b.num_pending == 1  # it sampled again
    assert b.num_computed_tokens == 8


def test_a_request_that_finishes_in_the_queue_leaves_it():
    sched = scheduler()
    a = make_seq("a", 5, max_tokens=1)
    sched.add(a)
    launch_step(sched)
    sched._preempt(a)  # as a preemption would, while its last token is in flight
    assert list(sched.waiting) == [a]
    assert land_token(sched, a)
    assert a.status is SequenceStatus.FINISHED and not sched.waiting
    assert not sched.has_unfinished()


def test_preemption_passes_over_a_request_ending_with_its_pending_token():
    sched = scheduler(blocks=4, block_size=4, seqs=4, budget=64)
    a = make_seq("a", 8, max_tokens=8)
    c = make_seq("c", 4, max_tokens=8, base=50)
    b = make_seq("b", 4, max_tokens=1, base=90)  # the newest; its one token is its last
    for seq in (a, c, b):
        sched.add(seq)
    launch_step(sched)  # 2 + 1 + 1 blocks: the pool is full
    out = launch_step(sched)  # b's block goes back and a takes it; c finds none
    assert [ch.seq for ch in out.chunks] == [a]
    assert out.num_preempted == 1 and c.status is SequenceStatus.WAITING
    assert b.status is SequenceStatus.RUNNING  # not "preempted": it holds nothing
    assert land_token(sched, b)
    sched.kv.check_integrity()


def document_rows(doc: str, base: int, max_tokens: list[int]) -> list[Sequence]:
    """Chunk prompts of one document: its 16 tokens (4 blocks of 4), then 3 of their own."""
    document = list(range(base, base + 16))
    return [
        Sequence(f"{doc}{i}", document + [base + 100 + 3 * i + j for j in range(3)],
                 SamplingParams(max_tokens=m))
        for i, m in enumerate(max_tokens)
    ]  # fmt: skip


def documents_per_step(seats: int) -> list[set[str]]:
    """Two documents' rows (the first's rows end at different steps) through a scheduler with
    `seats` places: the rows each step's chunks belong to."""
    sched = scheduler(blocks=32, block_size=4, seqs=seats, budget=64)
    rows = document_rows("a", 1000, [1, 3, 6]) + document_rows("b", 2000, [6, 6, 6])
    for seq in rows:
        sched.add(seq)
    steps = []
    while sched.has_unfinished():
        steps.append({c.seq.request_id for c in run_step(sched).chunks})
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in rows)
    return steps


def test_a_group_waits_to_start_whole_rather_than_trickle_in():
    """Four places for two documents of three rows: the second document's rows are not
    admitted one by one as the first's finish (b0 in the first step, beside a's three), but
    together once three places are free."""
    steps = documents_per_step(seats=4)
    first_b = next(i for i, rows in enumerate(steps) if any(r[0] == "b" for r in rows))
    assert first_b > 0 and {"b0", "b1", "b2"} <= steps[first_b]


def test_a_group_that_fits_whole_starts_beside_the_running_one():
    steps = documents_per_step(seats=8)
    assert steps[0] == {"a0", "a1", "a2", "b0", "b1", "b2"}  # both fit at once: nothing waits
