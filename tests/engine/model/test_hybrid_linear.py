"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, in
float32: the same greedy tokens with prompts cut into chunks mid-prompt, decodes and prefills
in one step, forced preemption and n = 2; broken checkpoints named; speculative decoding
refused; and prefix reuse at the ideal through state snapshots."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.kv.kv_cache import block_hashes
from kvbatch.engine.kv.memory import largest_step, run_step
from kvbatch.engine.model.checkpoint_errors import CheckpointError
from kvbatch.engine.model.loader import load_model
from kvbatch.jobs.grouping import group_by_prefix
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_hybrid import (
    HYBRID_KINDS,
    build_tiny_hybrid,
    build_tiny_qwen35_vision_language,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch at one thread: on a shared machine a second one only waits (see HELPERS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_tiny_hybrid(kind, root / kind)
        return built[kind]

    return get


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _llm(path, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24)
    return LLM(str(path), **{**args, **kw})


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_greedy_equals_transformers_with_chunks_cut_mid_prompt(hybrid, kind):
    """Prompts of 70, 41 and 5 tokens on a budget of 24 tokens a step: the long ones are cut
    mid-prompt and carry their states from chunk to chunk, while the short one decodes."""
    path = hybrid(kind)
    prompts = _prompts(1, (70, 41, 5))
    llm = _llm(path)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(
        path, prompts, GREEDY.max_tokens, ignore_eos=True
    )


def test_forced_preemption_recomputes_the_states(hybrid):
    """A KV pool too small for every sequence at once: the newest are preempted, their states
    dropped, and they are recomputed to the same tokens."""
    path = hybrid("qwen3.5")
    prompts = _prompts(2, (30, 29, 31, 30))  # two blocks each, a third once decoding
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = _llm(path, num_kv_blocks=9, block_size=16, max_model_len=64, max_num_batched_tokens=128)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert _tokens(outs) == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    llm.engine.kv.check_integrity()


def test_n_2_choices_each_equal_transformers(hybrid):
    """Choice 1 shares no blocks with choice 0 (fork returns 0): it is queued and starts from
    the state snapshot choice 0 left at their branch point."""
    path = hybrid("qwen3-next")
    prompt = _prompts(3, (37,))[0]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2)
    llm = _llm(path)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ref = hf_greedy(path, [prompt], 5, ignore_eos=True)[0]
    assert [c.token_ids for c in out.outputs] == [ref, ref]
    # the child starts from the snapshot at the prompt's last full block, not from scratch
    assert llm.stats().prefix_hits == 32


def test_speculative_decoding_is_refused(hybrid):
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        _llm(hybrid("qwen3.5"), speculative="ngram")


@pytest.mark.parametrize(
    "drop", ["model.layers.1.linear_attn.A_log", "model.layers.0.linear_attn.conv1d.weight"]
)
def test_a_missing_linear_attention_weight_is_named(hybrid, tmp_path, drop):
    src = hybrid("qwen3.5")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    del weights[drop]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=drop.replace(".", r"\.")):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_an_unknown_layer_type_is_named(hybrid, tmp_path):
    src = hybrid("qwen3-next")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'sliding_attention'"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def _two_level_job(seed: int, bs: int):
    """A system prompt, documents, questions on each; shuffled, then in the job's order."""
    rng = random.Random(seed)
    vocab = range(3, 512)
    system = rng.choices(vocab, k=rng.randint(20, 40))
    groups = []
    for _ in range(16):
        doc = rng.choices(vocab, k=rng.randint(48, 96))
        groups.append([system + doc + rng.choices(vocab, k=rng.randint(1, 16)) for _ in range(3)])
    prompts = [p for g in groups for p in g]
    rng.shuffle(prompts)
    order = group_by_prefix(prompts, bs)
    return [prompts[i] for i in order.order], order


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_two_level_job_prefill_stays_at_the_ideal(hybrid, seed):
    """System prompt -> documents -> questions on Qwen3.5, a KV pool of a third of the job's
    distinct prefix blocks: each distinct prefix is computed once (prefix hits = the ideal of
    the order), served from state snapshots at the branch points with the full-attention
    KV from the paged cache; the answers equal those with prefix caching off."""
    bs = 16
    prompts, order = _two_level_job(seed, bs)
    distinct = len({h for p in prompts for h in block_hashes(p, bs)})
    longest = max(map(len, prompts)) + GREEDY.max_tokens
    kw = dict(block_size=bs, max_num_seqs=2, max_model_len=longest, max_num_batched_tokens=32)
    # two running sequences at full length (the shared prefix within them) and a spare block
    blocks = 2 * (-(-longest // bs) + 1) + 1
    assert 3 * blocks <= distinct
    path = hybrid("qwen3.5")
    llm = _llm(path, num_kv_blocks=blocks, **kw)
    cached = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.stats()
    assert stats.prefix_hits == order.ideal_cached_tokens > 0
    assert stats.computed_tokens == stats.prompt_tokens - order.ideal_cached_tokens + (
        len(prompts) * (GREEDY.max_tokens - 1)
    )
    llm.engine.kv.check_integrity()
    plain = _llm(path, num_kv_blocks=blocks, enable_prefix_caching=False, **kw)
    assert _tokens(plain.generate(prompts, GREEDY, use_tqdm=False)) == cached


def test_the_language_model_of_a_qwen35_vision_language_checkpoint(tmp_path):
    """Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: the engine runs
    their language model (the vision tower and the MTP tensors unread) and answers text
    prompts as transformers' whole model does."""
    path = build_tiny_qwen35_vision_language(tmp_path / "vl")
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == "Qwen3_5ForCausalLM"
    prompts = _prompts(6, (30, 9))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
            )
        want.append(out[0, len(ids) :].tolist())
    assert _tokens(_llm(path).generate(prompts, GREEDY, use_tqdm=False)) == want


@pytest.mark.slow
def test_greedy_on_the_triton_backend_equals_the_torch_backend(hybrid):
    """The triton backend runs the decodes' rule as one kernel (the interpreter on the CPU)."""
    path = hybrid("qwen3.5")
    prompts = _prompts(7, (12, 5))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = _tokens(_llm(path).generate(prompts, params, use_tqdm=False))
    llm = _llm(path, attention_backend="triton", cascade_attention=False)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want


def test_a_forward_outside_the_runner_starts_from_zero_states(hybrid):
    """The startup's profile step (and any caller without a StatefulMeta) runs each chunk
    from zero states: a whole prompt gives transformers' logits, and the profile step runs."""
    path = hybrid("qwen3-next")
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    ids = _prompts(8, (21,))[0]
    torch.testing.assert_close(
        prefill_logits(loaded.model, ids, len(ids)), hf_logits(path, ids), atol=1e-4, rtol=0
    )
    step = largest_step(
        loaded.model, num_tokens=40, max_model_len=16, max_num_seqs=3, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    probs = run_step(loaded.model, TorchAttentionBackend(), step)
    assert probs.shape[-1] == 512 and torch.isfinite(probs).all()
