"""The triton attention backend gives the torch backend's greedy tokens (on the CPU under
TRITON_INTERPRET=1, on CUDA when there is one), with shared prefixes, chunked prefill and the
padded decode-graph path; and the largest-step profile runs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import TorchAttentionBackend, get_backend
from engine.cuda_graphs import batch_buckets
from engine.memory import largest_step, run_step
from engine.step_cost import PROBE_TOKENS
from tests.engine.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.reference import hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(path, prompts, **engine_args):
    llm = LLM(path, device=DEVICE, dtype="float32", **engine_args)
    outs = llm.generate(prompts, GREEDY)
    llm.engine.kv.check_integrity()
    return tokens(outs), llm


@pytest.fixture(scope="module")
def torch_tokens(tiny_models):
    return generate(tiny_models("llama-gqa"), shared_prefix_prompts(), attention_backend="torch")[0]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),  # shared prefixes: prefix-cache hits in prefill, cascade groups in decode
        dict(cascade_attention=False, max_num_batched_tokens=32),  # chunked prefill
        dict(async_scheduling=True, max_num_batched_tokens=32),  # decodes read pending tokens
    ],
    ids=["cascade", "chunked", "async"],
)
def test_triton_backend_gives_the_torch_backends_tokens(tiny_models, torch_tokens, engine_args):
    got, llm = generate(
        tiny_models("llama-gqa"), shared_prefix_prompts(), attention_backend="triton", **engine_args
    )
    assert llm.engine.runner.backend.name == "triton"
    assert got == torch_tokens


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2"])
def test_triton_backend_matches_transformers(tiny_models, kind):
    """Float32 greedy tokens equal transformers' (on CUDA when there is one: the GPU check)."""
    path = tiny_models(kind)
    prompts = random_prompts(512, (7, 30, 18), seed=5)
    got, _ = generate(path, prompts, attention_backend="triton")
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_padded_decode_graph_path_gives_the_same_tokens(tiny_models):
    """The static-buffer path of CUDA graphs (padding rows: slot -1, length 0), run eagerly:
    batches of 1..5 decodes land in buckets 1, 2, 4, 8 with padding rows."""
    path = tiny_models("llama-mha")
    prompts = random_prompts(512, (5, 19, 33, 2, 40), seed=3)
    want, _ = generate(path, prompts, attention_backend="triton", cascade_attention=False)
    llm = LLM(
        path, device=DEVICE, dtype="float32", attention_backend="triton", cascade_attention=False
    )
    llm.engine.runner.capture_decode_graphs(max_batch=8, max_model_len=64, capture=False)
    replays = []
    graphs = llm.engine.runner.decode_graphs
    real_run = graphs.run
    graphs.run = lambda ids, *a: replays.append(ids.shape[0]) or real_run(ids, *a)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert replays and max(replays) == 5
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "async"])
def test_padded_decode_graph_path_with_shared_prefix_groups(tiny_models, async_scheduling):
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
    llm.engine.runner.capture_decode_graphs(max_batch=8, max_model_len=128, capture=False)
    graphs = llm.engine.runner.decode_graphs
    seen = []  # (rows, groups) of every graphed step
    real_run = graphs.run
    graphs.run = lambda ids, pos, meta: (
        seen.append((ids.shape[0], len(meta.decode_groups))) or real_run(ids, pos, meta)
    )
    assert tokens(llm.generate(prompts, params)) == want
    assert (7, 2) in seen  # both groups, one padding row
    assert any(g == 1 for _, g in seen)  # group b dissolved (its member with 2 tokens is done)
    assert any(g == 0 for _, g in seen)  # plain decode steps still replay the plain graphs
    llm.engine.kv.check_integrity()


def test_short_chunks_of_a_long_prompt_split_their_keys(tiny_models, monkeypatch):
    """Chunked prefill of a long prompt in short chunks: the prefill kernel splits the cached
    context's keys across programs (the threshold lowered so the tiny model's contexts
    qualify) and merges them; the tokens are the torch backend's."""
    import kernels.prefill_attention as prefill

    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (230, 100, 9), seed=7)
    args = dict(cascade_attention=False, max_num_batched_tokens=48)
    want, _ = generate(path, prompts, attention_backend="torch", **args)
    monkeypatch.setattr(prefill, "MIN_KEYS_PER_SPLIT", 32)
    chosen = []
    choose = prefill.choose_prefill_splits
    monkeypatch.setattr(
        prefill, "choose_prefill_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1]
    )
    got, _ = generate(path, prompts, attention_backend="triton", **args)
    assert got == want
    assert max(chosen) > 1 and min(chosen) == 1  # the long contexts split, the first chunks not


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_profiled_largest_step_runs(tiny_models, backend):
    """The step used to size the KV pool on CUDA: a full token budget in sequences no longer
    than the context, every slot distinct, logits for max_num_seqs rows."""
    llm = LLM(tiny_models("llama-gqa"), device=DEVICE, dtype="float32", max_model_len=64)
    model = llm.engine.model
    step = largest_step(
        model,
        num_tokens=100,
        max_model_len=40,
        max_num_seqs=7,
        block_size=16,
        dtype=torch.float32,
        device=torch.device(DEVICE),
    )
    assert [s.query_len for s in step.meta.prefills] == [39, 39, 22]
    assert step.meta.slot_mapping.unique().numel() == 100
    probs = run_step(model, get_backend(backend, torch.device(DEVICE)), step)
    assert probs.shape == (7, model.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(7))


def test_auto_backend_is_torch_on_the_cpu_and_triton_needs_a_gpu(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(get_backend("auto", cpu), TorchAttentionBackend)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("triton", cpu)
    with pytest.raises(ValueError, match="choose one of"):
        get_backend("flash", cpu)


@pytest.mark.gpu
def test_async_steps_wait_for_the_device_only_to_collect_tokens(tiny_models):
    """On CUDA a step queues its work and returns: nothing on the step path may synchronise
    with the device (a blocking copy, .item(), .tolist() of a CUDA tensor), or the host would
    wait for the step just queued and nothing would overlap. torch's sync debug mode raises
    at the first implicit synchronisation; the one wait allowed, the event in
    LaunchedStep.result, runs with it off. The tokens equal those of steps in turn."""
    path = tiny_models("llama-gqa")
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = tokens(
        LLM(path, device="cuda", dtype="bfloat16", async_scheduling=False).generate(prompts, params)
    )
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.decode_graphs is not None
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    for _ in range(3):  # prefill and the first decodes: kernels compile here
        outs.update((o.request_id, o) for o in engine.step())
    collect = engine._collect

    def collect_allowed(launched):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return collect(launched)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    engine._collect = collect_allowed
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):  # decode steps: graph replays with shared-prefix groups
            outs.update((o.request_id, o) for o in engine.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
        engine._collect = collect
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert [outs[i].outputs[0].token_ids for i in ids] == want


@pytest.mark.gpu
def test_timed_chunks_on_cuda_time_steps_with_events(tiny_models):
    """A long prompt's chunks sized from timed steps on CUDA (the default there): steps are
    timed with events (plausible times, plain and mixed steps told apart), the chunks start
    at the probe, and the tokens are those of untimed chunks (float32). That the timing never
    makes the step path wait on the device is checked by the test above (it times too)."""
    run = timed_chunks_run(tiny_models("llama-gqa"), device="cuda")
    timed_tokens, engine, chunks = run(2.5)
    cost = engine.step_cost
    assert cost is not None and 0 < cost.plain_seconds < 1.0 and cost.num_mixed >= 1
    assert chunks[0] == PROBE_TOKENS and len(chunks) >= 2
    untimed_tokens, untimed, untimed_chunks = run(0)
    assert untimed.step_cost is None and untimed_chunks[0] > PROBE_TOKENS
    assert timed_tokens == untimed_tokens


def timed_chunks_run(path, device, **engine_args):
    """run(ratio) -> (tokens, engine, the long prompt's chunks): four decoders, then a
    440-token prompt (longer than the 128-token threshold) while they decode."""
    decoders = random_prompts(512, (20, 33, 9, 14), seed=3)
    long_prompt = random_prompts(512, (440,), seed=4)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(ratio):
        llm = LLM(
            path,
            device=device,
            dtype="float32",
            max_num_seqs=16,
            long_prefill_token_threshold=128,
            long_prefill_step_ratio=ratio,
            **engine_args,
        )
        engine, outs, chunks = llm.engine, {}, []
        ids = [engine.add_request(p, params) for p in decoders]
        for _ in range(6):  # prefill and the first decodes (kernels compile here)
            outs.update((o.request_id, o) for o in engine.step())
        long_id = engine.add_request(long_prompt, long_params)
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            chunks.extend(c.num_new_tokens for c in out.chunks if c.seq.request_id == long_id)
            return out

        engine.scheduler.schedule = recording
        while engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step())
        assert sum(n for n in chunks if n > 1) + 4 >= len(long_prompt)
        got = [outs[i].outputs[0].token_ids for i in ids + [long_id]]
        return got, engine, [n for n in chunks if n > 1]

    return run
