"""CUDA graphs of steps (engine/cuda_graphs.py): the static-buffer path, run eagerly on the CPU
under TRITON_INTERPRET=1 and captured for real on CUDA, gives the tokens of eager steps for
decode steps (plain, with shared-prefix groups, with contexts past the plain tables: wide
graphs) and decode steps with one prompt chunk; and which graph a step takes."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.exec.cuda_graphs import GraphKey, StepGraphs, batch_buckets
from tests.engine.attention.test_triton_backend import (
    DEVICE,
    GREEDY,
    generate,
    poison_new_float_tensors,
    timed_chunks_run,
)
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens


def test_padded_decode_graph_path_gives_the_same_tokens(tiny_models, monkeypatch):
    """The static-buffer path of CUDA graphs (padding rows: slot -1, length 0), run eagerly:
    batches of 1..5 decodes land in buckets 1, 2, 4, 8 with padding rows."""
    path = tiny_models("llama-mha")
    prompts = random_prompts(512, (5, 19, 33, 2, 40), seed=3)
    want, _ = generate(path, prompts, attention_backend="torch", cascade_attention=False)
    llm = LLM(
        path, device=DEVICE, dtype="float32", attention_backend="triton", cascade_attention=False
    )
    llm.engine.runner.capture_step_graphs(max_batch=8, max_model_len=64, capture=False)
    replays = []
    graphs = llm.engine.runner.step_graphs
    real_run = graphs.run
    graphs.run = lambda key, ids, *a: replays.append(ids.shape[0]) or real_run(key, ids, *a)
    poison_new_float_tensors(monkeypatch)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert replays and max(replays) == 5
    llm.engine.kv.check_integrity()


def test_long_decode_contexts_use_wide_graphs_captured_on_first_use(tiny_models, monkeypatch):
    """Decode contexts past GRAPH_MAX_CONTEXT (lowered to 16 tokens: one block) replay graphs
    of wide tables, captured on first use (simulated on the CPU's eager graph path), not
    eager steps; once the long ones finish, the short contexts go back to the graphs captured
    at start. The tokens equal the torch backend's, with every new float tensor NaN."""
    import kvbatch.engine.exec.runner as runner

    monkeypatch.setattr(runner, "GRAPH_MAX_CONTEXT", 16)
    path = tiny_models("llama-mha")
    prompts = random_prompts(512, (5, 19, 33, 2, 40), seed=3)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (13, 3, 4, 12, 2)
    ]
    ref = LLM(path, device=DEVICE, dtype="float32", attention_backend="torch")
    want = tokens(ref.generate(prompts, params))
    llm = LLM(
        path, device=DEVICE, dtype="float32", attention_backend="triton", cascade_attention=False
    )
    llm.engine.runner.capture_step_graphs(max_batch=8, max_model_len=64, capture=False)
    graphs = llm.engine.runner.step_graphs
    assert (graphs.max_blocks, graphs.max_wide_blocks) == (1, 4)
    first_seen = set()
    simulate_graph_captures(graphs, first_seen)
    keys = []  # every graphed step's key, in order
    real_run = graphs.run
    graphs.run = lambda key, *a: keys.append(key) or real_run(key, *a)
    poison_new_float_tensors(monkeypatch)
    assert tokens(llm.generate(prompts, params)) == want
    wide = [k.wide for k in keys]
    assert wide[0] and False in wide and wide[-1]  # long, short (<= 16), long (17) again
    assert first_seen == {k for k in keys if k.wide} and graphs.first_use_captures == len(
        first_seen
    )
    llm.engine.kv.check_integrity()


def test_the_graph_of_a_step_follows_its_decode_table_width():
    """key_for: tables up to max_blocks wide take the graphs captured at start, wider ones up
    to max_wide_blocks the wide graphs, wider still (or any past max_blocks without wide
    graphs) run eagerly; a chunk step keeps its table kind."""
    from kvbatch.engine.attention.metadata import AttentionMetadata

    def key(graphs, width, rows=3):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(rows, dtype=torch.long),
            num_decode_tokens=rows,
            decode_block_tables=torch.zeros(rows, width, dtype=torch.int32),
            decode_seq_lens=torch.ones(rows, dtype=torch.int32),
            prefills=[],
        )
        return graphs.key_for(meta, rows, rows)

    def step_graphs(max_wide_blocks):
        return StepGraphs(
            lambda *a: None,
            max_batch=8,
            max_blocks=4,
            device=torch.device("cpu"),
            capture=False,
            max_wide_blocks=max_wide_blocks,
        )

    graphs = step_graphs(max_wide_blocks=16)
    assert key(graphs, 4) == GraphKey(4, False) and not GraphKey(4, False).on_first_use
    assert (
        key(graphs, 5) == GraphKey(4, False, 0, True) and GraphKey(4, False, 0, True).on_first_use
    )
    assert key(graphs, 16) == GraphKey(4, False, 0, True)
    assert key(graphs, 17) is None
    assert tuple(graphs.wide_tables.shape) == (8, 16)
    no_wide = step_graphs(max_wide_blocks=4)  # no wider than the plain tables: none
    assert no_wide.max_wide_blocks == 0 and key(no_wide, 5) is None and key(no_wide, 4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "async"])
def test_padded_decode_graph_path_with_shared_prefix_groups(
    tiny_models, monkeypatch, async_scheduling
):
    """Cascade steps in the static buffers: groups come and go as their members finish at
    different lengths (a stale group left in the buffers would attend the wrong rows), and
    with 7 sequences the bucket of 8 has a padding row. With async scheduling the graphed
    decodes' input ids are the previous step's tokens, still on the device."""
    path = tiny_models("llama-gqa")
    prompts = shared_prefix_prompts()[:7]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for n in (9, 3, 7, 5, 2, 8, 6)
    ]
    ref = LLM(path, device=DEVICE, dtype="float32", attention_backend="torch")
    want = tokens(ref.generate(prompts, params))
    llm = LLM(
        path,
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        async_scheduling=async_scheduling,
    )
    llm.engine.runner.capture_step_graphs(max_batch=8, max_model_len=128, capture=False)
    graphs = llm.engine.runner.step_graphs
    seen = []  # (rows, groups) of every graphed step
    real_run = graphs.run
    graphs.run = lambda key, ids, pos, meta, rows: (
        seen.append((ids.shape[0], len(meta.decode_groups))) or real_run(key, ids, pos, meta, rows)
    )
    poison_new_float_tensors(monkeypatch)
    assert tokens(llm.generate(prompts, params)) == want
    assert (7, 2) in seen  # both groups, one padding row
    assert any(g == 1 for _, g in seen)  # group b dissolved (its member with 2 tokens is done)
    assert any(g == 0 for _, g in seen)  # plain decode steps still replay the plain graphs
    llm.engine.kv.check_integrity()


def long_prompt_beside_decodes(shared: bool):
    """Four short prompts that decode while a 150-token prompt is prefilled in short chunks
    (24 tokens a step, less the decodes), and their sampling params (uneven lengths: the
    decode rows change while the chunks go on)."""
    short = shared_prefix_prompts()[:4] if shared else random_prompts(512, (5, 19, 12, 9), seed=3)
    prompts = short + random_prompts(512, (150,), seed=4)
    lengths = (16, 12, 14, 3, 4)
    return prompts, [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths
    ]


@pytest.mark.parametrize(
    "async_scheduling, shared, split, wide",
    [(False, False, True, False), (True, True, False, False), (False, False, False, True)],
    ids=["in-turn-split-keys", "async-shared-prefixes", "in-turn-wide-tables"],
)
def test_padded_mixed_step_graph_path_gives_the_same_tokens(
    tiny_models, monkeypatch, async_scheduling, shared, split, wide
):
    """Decode steps with one prompt chunk in the static buffers, run eagerly: the chunks land
    in buckets 16 and 32 with padding rows after the decode bucket's padding, and the long
    prompt's last chunk samples through its remapped logits row. Async: the decodes read
    pending tokens. Shared prefixes: cascade groups beside the chunk. Split keys (threshold
    lowered): each chunk's keys split for the longest context, most splits empty. Wide tables
    (GRAPH_MAX_CONTEXT lowered to 16 tokens): the decodes beside the chunk past one block.
    New float tensors are NaN, so no real row reads a padding row's (or any unwritten)
    output."""
    import kvbatch.engine.exec.runner as runner
    import kvbatch.kernels.prefill_attention as prefill

    path = tiny_models("llama-gqa")
    prompts, params = long_prompt_beside_decodes(shared)
    args = dict(device=DEVICE, dtype="float32", max_num_batched_tokens=24, max_model_len=256)
    want = tokens(LLM(path, attention_backend="torch", **args).generate(prompts, params))
    if split:
        monkeypatch.setattr(prefill, "MIN_KEYS_PER_SPLIT", 32)
    if wide:
        monkeypatch.setattr(runner, "GRAPH_MAX_CONTEXT", 16)
    llm = LLM(path, attention_backend="triton", async_scheduling=async_scheduling, **args)
    llm.engine.runner.capture_step_graphs(
        max_batch=8, max_model_len=256, max_chunk=32, capture=False
    )
    graphs = llm.engine.runner.step_graphs
    seen = []  # (key, decodes, chunk tokens, sampled rows) of every graphed mixed step
    real_run = graphs.run

    def run(key, ids, positions, meta, rows):
        nd = meta.num_decode_tokens
        if key.chunk:
            seen.append((key, nd, ids.shape[0] - nd, rows.shape[0], len(meta.decode_groups)))
        return real_run(key, ids, positions, meta, rows)

    graphs.run = run
    poison_new_float_tensors(monkeypatch)
    assert tokens(llm.generate(prompts, params)) == want
    assert {key.chunk for key, *_ in seen} == ({32} if shared else {16, 32})
    assert any(m < key.chunk for key, _, m, _, _ in seen)  # a padded chunk
    assert any(nd < key.rows for key, nd, *_ in seen)  # padded decode rows before the chunk
    assert any(rows == nd + 1 for _, nd, _, rows, _ in seen)  # the last chunk sampled
    assert any(groups for *_, groups in seen) == shared
    assert any(key.wide for key, *_ in seen) == wide
    llm.engine.kv.check_integrity()


def test_a_graph_run_on_buffers_reset_to_padding_writes_no_kv(tiny_models):
    """What `capture_chunk_buckets` does before each capture (CUDA), eagerly on the CPU: after
    a job's mixed steps, the buffers reset to padding, then each chunk bucket of the decode
    size met runs, with and without groups, and leaves the KV cache untouched."""
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (5, 9, 40), seed=5)  # the 40-token one in chunks beside
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=20, max_model_len=64)
    llm.engine.runner.capture_step_graphs(
        max_batch=4, max_model_len=64, max_chunk=32, capture=False
    )
    graphs = llm.engine.runner.step_graphs
    met = set()
    real_run = graphs.run
    graphs.run = lambda key, *a: met.add(key) or real_run(key, *a)
    llm.generate(prompts, params)
    (b,) = {key.rows for key in met if key.chunk}
    kv = [c.clone() for c in llm.engine.runner.kv_caches]
    for key in (GraphKey(b, False, 16), GraphKey(b, True, 32)):
        graphs.reset_to_padding()
        logits = graphs._run(key)
        assert logits.shape[0] == b + 1 and torch.isfinite(logits).all()
    assert all(torch.equal(a, c) for a, c in zip(kv, llm.engine.runner.kv_caches))


def simulate_graph_captures(graphs, first_seen: set) -> None:
    """What a capture on first use leaves behind (CUDA), on the CPU's eager graph path: the
    capture count grows once per new pair of buckets (recorded in `first_seen`)."""
    graphs.capture = True

    def capture(key):
        if key not in first_seen:
            first_seen.add(key)
            graphs.first_use_captures += 1

    graphs._capture_on_first_use = capture


def test_a_step_that_captures_a_graph_is_not_timed(tiny_models):
    """On CUDA a mixed step's graph is captured right after the step first runs eagerly, and
    the capture's wait lands in that step's time: the step cost model must not learn from it
    (one such step would shrink the next chunks for nothing). The capture is simulated on the
    CPU's eager graph path, once per new key; the other mixed steps are timed."""
    first_seen, mixed_steps, timed = set(), [], []

    def simulate_captures(engine):
        engine.runner.capture_step_graphs(
            max_batch=8, max_model_len=512, max_chunk=512, capture=False
        )
        simulate_graph_captures(engine.runner.step_graphs, first_seen)
        launch, observe = engine.runner.launch, engine.step_cost.observe
        engine.runner.launch = lambda out, *a: (
            mixed_steps.append(out.shape.is_mixed) or launch(out, *a)
        )
        engine.step_cost.observe = lambda shape, s: (
            timed.append(shape.is_mixed) or observe(shape, s)
        )

    run = timed_chunks_run(
        tiny_models("llama-gqa"),
        DEVICE,
        attention_backend="triton",
        prepare=simulate_captures,
        long_len=200,  # the interpreter's steps are slow: a few chunks after the probe
        decode_len=20,  # decoding through the whole prefill
    )
    _, _, chunks = run(2.5)
    assert len(chunks) >= 3
    assert first_seen and sum(mixed_steps) > len(first_seen)
    assert sum(timed) == sum(mixed_steps) - len(first_seen)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def test_the_chunk_buckets_left_to_capture_are_those_of_decode_sizes_met_with_a_chunk():
    """After a run, the graphs still to capture (`capture_chunk_graphs`): for each (decode
    bucket, groups) pair that met a chunk, its chunk buckets not yet captured, largest first;
    pairs that never met a chunk get none. Without CUDA nothing is captured."""
    graphs = StepGraphs(
        lambda *a: None,
        max_batch=16,
        max_blocks=4,
        device=torch.device("cpu"),
        capture=False,
        max_chunk=64,
        max_prefill_tokens=128,
    )
    assert graphs.chunks == [16, 32, 48, 64] and graphs.missing_chunk_graphs() == []
    graphs.graphs = {k: object() for k in (GraphKey(8, False), GraphKey(16, True))}
    graphs.graphs |= {GraphKey(8, False, 32): object(), GraphKey(16, True, 16): object()}
    assert graphs.missing_chunk_graphs() == [
        GraphKey(16, True, 64),
        GraphKey(16, True, 48),
        GraphKey(16, True, 32),
        GraphKey(8, False, 64),
        GraphKey(8, False, 48),
        GraphKey(8, False, 16),
    ]
    slots = graphs.slots.clone()
    assert graphs.capture_chunk_buckets() == 0 and torch.equal(graphs.slots, slots)


def test_capturing_chunk_graphs_waits_for_an_idle_engine(tiny_models):
    llm = LLM(tiny_models("llama-gqa"), attention_backend="triton", max_model_len=64)
    engine = llm.engine
    assert engine.capture_chunk_graphs() == 0  # no step graphs on the CPU
    engine.add_request([5, 9, 17], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="requests are still running"):
        engine.capture_chunk_graphs()


@pytest.mark.gpu
def test_mixed_step_graphs_on_cuda_are_captured_on_first_use(tiny_models):
    """On CUDA a decode step with a short prompt chunk captures its graph the first time its
    buckets are seen and replays it after: the tokens equal those of eager mixed steps
    (float32), and each captured key stays captured."""
    path = tiny_models("llama-gqa")
    prompts, params = long_prompt_beside_decodes(shared=False)
    args = dict(device="cuda", dtype="float32", max_num_batched_tokens=24, max_model_len=256)
    eager = LLM(path, cuda_graph_max_chunk=0, **args)
    want = tokens(eager.generate(prompts, params))
    assert eager.engine.runner.step_graphs.first_use_captures == 0
    llm = LLM(path, cuda_graph_max_chunk=32, **args)
    graphs = llm.engine.runner.step_graphs
    # the decode graphs captured at start were launched (twice: first, and again for the log)
    at_start = set(graphs.graphs)
    assert at_start and graphs.first_launches.graphs == len(at_start)
    assert all(graphs.launches[key] == 2 for key in at_start)
    replays = []
    real_run = graphs.run
    graphs.run = lambda key, *a: replays.append(key) or real_run(key, *a)
    assert tokens(llm.generate(prompts, params)) == want
    mixed = {key for key in graphs.graphs if key.chunk}
    assert graphs.first_use_captures == len(mixed) >= 1
    assert len([key for key in replays if key.chunk]) > len(mixed)  # replayed after capture
    llm.engine.kv.check_integrity()
    # the rest of the chunk buckets of the decode sizes met, captured between jobs: a second
    # job captures nothing for those sizes, and its tokens do not change
    missing = graphs.missing_chunk_graphs()
    kv = [c.clone() for c in llm.engine.runner.kv_caches]
    launched = graphs.first_launches
    assert llm.engine.capture_chunk_graphs() == len(missing)
    assert graphs.missing_chunk_graphs() == []
    # and launched ahead of their first step, on buffers of padding: no KV written
    if missing:
        assert graphs.first_launches.graphs == len(missing)
    else:  # (the job met every bucket) nothing new to launch
        assert graphs.first_launches is launched
    assert all(graphs.launches[key] == 2 for key in missing)
    assert all(torch.equal(a, c) for a, c in zip(kv, llm.engine.runner.kv_caches))
    assert graphs.first_use_captures == len(mixed) + len(missing)
    pairs = {(key.rows, key.cascade) for key in graphs.graphs if key.chunk}
    before = set(graphs.graphs)
    assert tokens(llm.generate(prompts, params)) == want
    assert all((k.rows, k.cascade) not in pairs for k in set(graphs.graphs) - before)
    llm.engine.kv.check_integrity()


@pytest.mark.gpu
def test_wide_decode_graphs_on_cuda_are_captured_on_first_use(tiny_models, monkeypatch):
    """On CUDA decode contexts past GRAPH_MAX_CONTEXT (lowered to 16 tokens) capture a wide
    graph the first time its bucket is seen and replay it after: float32 tokens equal those
    of eager steps."""
    import kvbatch.engine.exec.runner as runner

    monkeypatch.setattr(runner, "GRAPH_MAX_CONTEXT", 16)
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (5, 19, 33, 2, 40), seed=3)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (13, 9, 10, 12, 8)
    ]
    args = dict(device="cuda", dtype="float32", max_model_len=128)
    want = tokens(LLM(path, cuda_graphs=False, **args).generate(prompts, params))
    llm = LLM(path, **args)
    graphs = llm.engine.runner.step_graphs
    assert graphs.max_wide_blocks == 8
    replays = []
    real_run = graphs.run
    graphs.run = lambda key, *a: replays.append(key) or real_run(key, *a)
    assert tokens(llm.generate(prompts, params)) == want
    wide = {key for key in graphs.graphs if key.wide}
    assert wide and graphs.first_use_captures == len(wide)
    assert len([key for key in replays if key.wide]) > len(wide)  # replayed after capture
    llm.engine.kv.check_integrity()
