"""Gemma 4 (text; engine/models/gemma4.py) against transformers in float32. The tiny "gemma4"
has every feature on: caches of two shapes (global layers: head_dim 32), KV-shared last
layers with double-wide MLPs, K = V on the global layers, the MoE block beside each MLP,
per-layer inputs, layer scalars and a final soft-cap; "gemma4-dense" has the shapes, the
per-layer inputs and the soft-cap only.

Gemma 4 attends at scale 1 (no 1/sqrt(d)), which makes float32 rounding show more in its
logits than in other families': transformers' own float32 logits are ~3e-4 from its float64
ones on these models, so logits are compared at 1e-3 (greedy tokens exactly)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForImageTextToText, Gemma4Config

from kvbatch.engine import LLM
from kvbatch.engine.model.gguf import GgufFile, complete_config
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.gemma4 import Gemma4ForCausalLM, kv_owners
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts
from tests.engine.model.family_checks import (
    CPU,
    ENGINE_SETTINGS,
    GREEDY,
    assert_logits_match,
    assert_ngram_spec_matches,
    assert_triton_matches,
)
from tests.engine.model.test_model import prefill_logits
from tests.engine.model.test_window_kv import whole_requests_at_once
from tests.reference import assert_greedy_matches_transformers
from tests.tiny_models import (
    build_tiny_checkpoint,
    gemma4_config,
    randomize_weights,
)

KINDS = ("gemma4", "gemma4-dense")
ATOL = 1e-3


def test_config_reads_shapes_sharing_and_features(tiny_models):
    loaded = load_model(tiny_models("gemma4"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    g = cfg.family
    assert isinstance(model, Gemma4ForCausalLM)
    assert [cfg.kv_shape(i) for i in range(6)] == [(1, 16), (1, 16), (1, 32)] * 2
    assert [cfg.kv_owner(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]  # last of their type
    assert g.k_eq_v and g.num_experts == 4 and g.final_logit_softcap == 8.0
    assert g.global_rope.rope_type == "proportional" and g.global_rope.head_dim == 32
    layers = model.model.layers
    assert not hasattr(layers[2].self_attn, "v_proj")  # K = V on the global layers
    assert hasattr(layers[0].self_attn, "v_proj")
    assert not hasattr(layers[4].self_attn, "k_proj")  # KV-shared: no K or V of its own
    assert layers[4].mlp.gate_proj.out_features == 2 * layers[0].mlp.gate_proj.out_features
    assert layers[5].layer_scalar.item() == pytest.approx(1.0)  # the checkpoint's, not 1s
    assert layers[0].layer_scalar.item() == pytest.approx(0.5)


def test_kv_owners_follow_transformers_sharing_modes():
    types = ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert kv_owners(types, 0) == tuple(range(6))
    assert kv_owners(types, 3) == (0, 1, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="no layer computing K and V"):
        kv_owners(types, 6)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_models, kind):
    assert_logits_match(tiny_models(kind), atol=ATOL)


@pytest.mark.parametrize(
    "change",
    [
        dict(final_logit_softcapping=None),
        dict(sliding_window=64),
        dict(hidden_size_per_layer_input=0),
    ],
    ids=["final-cap", "window", "no-per-layer-inputs"],
)
def test_each_feature_changes_the_logits(tiny_models, tmp_path, change):
    """Each feature is really applied: the same checkpoint with it changed gives other
    logits, still transformers' for the changed config (per-layer inputs off: rebuilt)."""
    src = tiny_models("gemma4-dense")
    if "hidden_size_per_layer_input" in change:
        other = build_tiny_checkpoint("gemma4-dense", tmp_path / "m", **change)
    else:
        shutil.copytree(src, tmp_path / "m")
        cfg = json.loads((tmp_path / "m" / "config.json").read_text()) | change
        (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
        other = tmp_path / "m"
    ids = random_prompts(512, (60,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 60)
    b = prefill_logits(load_model(other, torch.float32, CPU).model, ids, 60)
    assert (a - b).abs().max() > 1e-2
    assert_logits_match(other, chunks=(None, 7), atol=ATOL)


GREEDY_CASES = [
    pytest.param(
        kind,
        settings,
        id=f"{kind}-{name}",
        # the dense kind's KV paths are the full kind's; its prefix-cache case is enough fast
        marks=[pytest.mark.slow] if kind == "gemma4-dense" and name != "cache" else [],
    )
    for kind in KINDS
    for name, settings in ENGINE_SETTINGS.items()
]


@pytest.mark.parametrize(("kind", "settings"), GREEDY_CASES)
def test_greedy_matches_transformers(tiny_models, kind, settings):
    assert_greedy_matches_transformers(tiny_models(kind), shared_prefix_prompts(), GREEDY, settings)


def test_ngram_speculative_decoding_matches_transformers(tiny_models):
    assert_ngram_spec_matches(tiny_models("gemma4"))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_backend_matches_transformers(tiny_models, kind):
    """The kernels read and write the strided caches of a slot shared by two shapes, and the
    KV-shared layers' q-only rotation."""
    assert_triton_matches(tiny_models(kind))


def test_caches_of_two_shapes_share_a_slot(tiny_models):
    """With window groups a slot holds a global layer's blocks (32 values a token) and local
    layers' (16): it is as wide as the widest, the local layers' blocks strided views of it;
    the KV-shared layers hold their owners' tensors."""
    llm = LLM(str(tiny_models("gemma4")), device="cpu", num_kv_blocks=32, max_model_len=64)
    layout, caches = llm.engine.kv_layout, llm.engine.runner.kv_caches
    assert all(4 not in g.layers and 5 not in g.layers for g in layout.groups)
    assert caches[4] is caches[3] and caches[5] is caches[2]
    assert caches[2].shape == (2, 32, 16, 1, 32) and caches[2].is_contiguous()
    assert caches[0].shape == (2, 32, 16, 1, 16) and not caches[0].is_contiguous()
    assert caches[0].untyped_storage().data_ptr() == caches[2].untyped_storage().data_ptr()


def test_shared_layers_fit_more_sequences(tiny_models, tmp_path, caplog):
    """The same model without KV-shared layers holds KV for all six layers; with two of them
    reading earlier layers' caches, the same bytes hold more requests (startup line)."""
    unshared = build_tiny_checkpoint("gemma4", tmp_path / "m", num_kv_shared_layers=0)
    caplog.set_level(logging.INFO, logger="kvbatch.engine.kv.sizing")
    kw = dict(device="cpu", kv_cache_bytes=1 << 20, max_model_len=512, max_num_batched_tokens=32)
    fits = {}
    for name, path in (("shared", tiny_models("gemma4")), ("unshared", unshared)):
        for window_groups in (True, False):
            caplog.clear()
            LLM(str(path), sliding_window_kv=window_groups, **kw)
            fits[name, window_groups] = whole_requests_at_once(caplog.records)
    for window_groups in (True, False):
        assert fits["shared", window_groups] > fits["unshared", window_groups]
    assert fits["shared", True] > fits["shared", False]  # and the windows free blocks
    # one table: a token's K/V takes 4 x 16 + 2 x 32 values over six layers without sharing,
    # 3 x 16 + 32 over the four layers that own KV with it
    assert fits["shared", False] / fits["unshared", False] == pytest.approx(
        (4 * 16 + 2 * 32) / (3 * 16 + 32), rel=0.05
    )


def test_bidirectional_attention_is_refused(tiny_models, tmp_path):
    shutil.copytree(tiny_models("gemma4-dense"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(
        json.dumps(cfg | {"use_bidirectional_attention": "all"})
    )
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        load_model(tmp_path / "m", torch.float32, CPU)


def test_the_text_model_of_a_multimodal_checkpoint(tmp_path, caplog):
    """A Gemma4ForConditionalGeneration checkpoint (vision tower beside the text model) runs
    its text model, with a note in the log; logits are the whole model's on text."""
    text = gemma4_config(full=True).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = AutoModelForImageTextToText.from_config(
        Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    )
    randomize_weights(model, seed=3)
    model.save_pretrained(tmp_path / "mm")
    caplog.set_level(logging.INFO, logger="kvbatch.engine.model.multimodal")
    loaded = load_model(tmp_path / "mm", torch.float32, CPU)
    assert isinstance(loaded.model, Gemma4ForCausalLM)
    assert any("Gemma4ForConditionalGeneration" in r.getMessage() for r in caplog.records)
    ids = random_prompts(512, (40,), seed=5)[0]
    with torch.inference_mode():
        ref = model.eval()(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 9), ref, atol=ATOL, rtol=0)


def test_a_gemma4_gguf_file_is_refused():
    """transformers' GGUF reader maps few of Gemma 4's keys: the file is refused, not misread."""
    file = GgufFile("gemma4", {"general.architecture": "gemma4"}, {})
    with pytest.raises(ValueError, match="Gemma 4 GGUF files are not supported yet"):
        complete_config(file, gemma4_config(full=False))
