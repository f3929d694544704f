"""The tiny checkpoints are what they claim, and tests.reference behaves as documented."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.reference import hf_greedy, hf_logits, hf_model
from tests.tiny_models import LLAMA3_ROPE, LLAMA_KINDS, VOCAB_SIZE, build_tiny_checkpoint

PROMPTS = [[7], [5, 77, 300, 41], list(range(3, 40))]


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", LLAMA_KINDS)
def test_every_kind_loads_back_and_generates(tiny_models, kind):
    path = tiny_models(kind)
    model = hf_model(path)
    cfg = model.config
    assert cfg.vocab_size == VOCAB_SIZE and cfg.bos_token_id == 1 and cfg.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert cfg.num_key_value_heads == (4 if kind == "llama-mha" else 2)
    assert cfg.tie_word_embeddings == (kind == "qwen2")
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    outs = hf_greedy(path, PROMPTS, 8, ignore_eos=True)
    assert [len(o) for o in outs] == [8, 8, 8]
    assert all(0 <= t < VOCAB_SIZE for o in outs for t in o)
    logits = hf_logits(path, PROMPTS[1])
    assert logits.shape == (4, VOCAB_SIZE) and logits.dtype == torch.float32
    # The last position's argmax is the first greedy token.
    assert int(logits[-1].argmax()) == outs[1][0]


@pytest.mark.parametrize("kind", LLAMA_KINDS)
def test_constant_initialised_tensors_are_randomised(tiny_models, kind):
    """A loader that skips norm weights or biases must change the logits."""
    weights = tensors(tiny_models(kind))
    norms = [t for n, t in weights.items() if n.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1
    assert all((t - 1).abs().max() > 0.05 for t in norms)
    biases = [t for n, t in weights.items() if n.endswith(".bias")]
    if kind == "qwen2":
        assert len(biases) == 3 * 2  # q, k and v in each of the two layers; no o_proj bias
        assert all(t.abs().max() > 0.05 for t in biases)
    else:
        assert biases == []


def test_qwen2_ties_its_embeddings(tiny_models):
    path = tiny_models("qwen2")
    assert "lm_head.weight" not in tensors(path)  # saved once, as embed_tokens
    model = hf_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_llama3_rope_round_trips_and_is_applied(tiny_models, tmp_path):
    path = tiny_models("llama3-rope")
    saved = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert saved == LLAMA3_ROPE
    assert AutoConfig.from_pretrained(path).rope_parameters == LLAMA3_ROPE

    # transformers' rotary really uses llama3 frequencies: the highest one (wavelength 2*pi,
    # under high_freq_wavelen 8) is kept, the low ones (wavelength over 32) are divided by 8.
    inv_freq = hf_model(path).model.rotary_emb.inv_freq
    default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(inv_freq[0], default[0])
    assert torch.allclose(inv_freq[2:], default[2:] / 8)

    # Same weights with the default rotary give other logits (except at position 0).
    plain = tmp_path / "plain-rope"
    shutil.copytree(path, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = PROMPTS[2]
    a, b = hf_logits(path, ids), hf_logits(plain, ids)
    assert torch.allclose(a[0], b[0], atol=1e-5)
    assert (a[1:] - b[1:]).abs().max() > 1e-2


def test_sharded_kind_has_several_shards_and_llama_gqa_weights(tiny_models):
    path = tiny_models("llama-sharded")
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    whole = tensors(tiny_models("llama-gqa"))
    split = tensors(path)
    assert set(index["weight_map"]) == set(split) == set(whole)
    assert all(torch.equal(split[n], whole[n]) for n in whole)


def test_kinds_differ_and_seeds_reproduce(tiny_models, tmp_path):
    a = tensors(tiny_models("llama-gqa"))
    for kind in ("llama3-rope", "mistral"):  # same tensor names and shapes as llama-gqa
        b = tensors(tiny_models(kind))
        assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    again = tensors(build_tiny_checkpoint("llama-gqa", tmp_path / "again"))
    assert all(torch.equal(again[n], a[n]) for n in a)
    other = tensors(build_tiny_checkpoint("llama-gqa", tmp_path / "other", seed=1))
    assert not torch.equal(other["lm_head.weight"], a["lm_head.weight"])


def test_greedy_stops_at_eos_unless_ignored(tiny_models):
    path = tiny_models("llama-gqa")
    prompt = PROMPTS[1]
    (seq,) = hf_greedy(path, [prompt], 16, ignore_eos=True)
    k = next(i for i in range(1, len(seq)) if seq[i] not in seq[:i])
    eos = seq[k]  # pretend this greedy token is the end of sequence
    (stopped,) = hf_greedy(path, [prompt], 16, ignore_eos=False, eos_token_ids=[eos])
    assert stopped == seq[: k + 1]  # EOS included, like the engine reports it
    # ignore_eos keeps EOS as a possible token (vLLM semantics), unlike min_new_tokens.
    assert hf_greedy(path, [prompt], 16, ignore_eos=True, eos_token_ids=[eos]) == [seq]
    # Without an override the checkpoint's EOS (2) applies; the prompt never produces it.
    if 2 not in seq:
        assert hf_greedy(path, [prompt], 16, ignore_eos=False) == [seq]


def test_reference_rejects_empty_prompts(tiny_models):
    with pytest.raises(ValueError):
        hf_logits(tiny_models("llama-gqa"), [])
    with pytest.raises(ValueError):
        hf_greedy(tiny_models("llama-gqa"), [[]], 4, ignore_eos=True)
