"""The triton attention backend gives the torch backend's greedy tokens (on the CPU under
TRITON_INTERPRET=1, on CUDA when there is one), with shared prefixes and chunked prefill; chunks
timed from steps; async steps that never wait for the device; and the largest-step profile
runs. CUDA graphs of steps: tests/engine/exec/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.attention.backends import get_backend
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.kv.memory import largest_step, run_step
from kvbatch.engine.sched.step_cost import PROBE_TOKENS
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.reference import hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(path, prompts, **engine_args):
    llm = LLM(path, device=DEVICE, dtype="float32", **engine_args)
    outs = llm.generate(prompts, GREEDY)
    llm.engine.kv.check_integrity()
    return tokens(outs), llm


def poison_new_float_tensors(monkeypatch) -> None:
    """From here on every float tensor from torch.empty / torch.empty_like is NaN: memory no
    kernel wrote (an attention output's chunk padding rows, a cascade partial of rows outside
    every group, a logits row past the sampled ones) is then NaN, not whatever was there, so a
    real row that reads any of it gets NaN logits and different tokens. Inside a CUDA graph
    such memory is the graph pool's leftovers, which can hold NaN or inf."""

    def poisoned(make):
        def new(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return new

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


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
def test_triton_backend_gives_the_torch_backends_tokens(
    tiny_models, torch_tokens, monkeypatch, engine_args
):
    poison_new_float_tensors(monkeypatch)  # cascade partials of rows outside every group
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


def test_short_chunks_of_a_long_prompt_split_their_keys(tiny_models, monkeypatch):
    """Chunked prefill of a long prompt in short chunks: the prefill kernel splits the cached
    context's keys across programs (the threshold lowered so the tiny model's contexts
    qualify) and merges them; the tokens are the torch backend's."""
    import kvbatch.kernels.prefill_attention as prefill

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
    torch.testing.assert_close(probs.sum(-1), torch.ones(7, device=probs.device))


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
    assert engine.async_scheduling and engine.runner.step_graphs is not None
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


def timed_chunks_run(path, device, prepare=None, long_len=440, decode_len=40, **engine_args):
    """run(ratio) -> (tokens, engine, the long prompt's chunks): four decoders of `decode_len`
    tokens, then a `long_len`-token prompt (longer than the 128-token threshold) while they
    decode. `prepare` gets the engine before it runs."""
    decoders = random_prompts(512, (20, 33, 9, 14), seed=3)
    long_prompt = random_prompts(512, (long_len,), seed=4)[0]
    params = SamplingParams(max_tokens=decode_len, temperature=0.0, ignore_eos=True)
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
        if prepare is not None:
            prepare(engine)
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
