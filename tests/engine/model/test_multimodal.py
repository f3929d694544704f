"""The text model of a vision-language checkpoint (Gemma 3 4B+, Mistral Small 3.1): tiny random
Gemma3ForConditionalGeneration and Mistral3ForConditionalGeneration checkpoints, saved by
transformers and in the layout the models were published in; on text prompts the engine's
logits and greedy tokens equal transformers' whole vision-language model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
)

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.gemma import GemmaForCausalLM
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.tiny_models import randomize_weights

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
KINDS = ("gemma3", "mistral3")


def build(kind: str, folder: Path, published_layout: bool) -> Path:
    """Save a tiny random `kind` vision-language model; `published_layout` renames its tensors
    as the released checkpoints name them (transformers reads both)."""
    if kind == "gemma3":
        config = Gemma3Config(
            text_config={**TEXT, "sliding_window": 8, "query_pre_attn_scalar": 16},
            vision_config={**VISION, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4,
        )
        model = Gemma3ForConditionalGeneration(config)
    else:
        config = Mistral3Config(
            text_config={**TEXT, "model_type": "mistral", "sliding_window": None},
            vision_config={**VISION, "model_type": "pixtral", "image_size": 28, "patch_size": 14},
            tie_word_embeddings=False,
        )
        model = Mistral3ForConditionalGeneration(config)
    randomize_weights(model, seed=len(kind))
    model.save_pretrained(folder)
    if published_layout:
        weights = folder / "model.safetensors"
        state = load_file(str(weights))
        save_file({_published(k): v for k, v in state.items()}, str(weights), {"format": "pt"})
    return folder


def _published(name: str) -> str:
    for new, old in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


@pytest.fixture(scope="module", params=[(k, p) for k in KINDS for p in (False, True)])
def checkpoint(request, tmp_path_factory):
    kind, published = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-{'published' if published else 'saved'}")
    return kind, build(kind, folder, published)


def reference(path: Path):
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def test_the_text_model_answers_as_the_whole_model(checkpoint):
    kind, path = checkpoint
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == (
        "Gemma3ForCausalLM" if kind == "gemma3" else "MistralForCausalLM"
    )
    assert isinstance(loaded.model, GemmaForCausalLM) == (kind == "gemma3")
    assert loaded.eos_token_ids[0] == 2
    ids = random_prompts(512, (29,), seed=4)[0]  # longer than Gemma's window of 8
    with torch.no_grad():
        want = reference(path)(torch.tensor([ids])).logits[0]
    for chunk in (29, 5):
        got = prefill_logits(loaded.model, ids, chunk)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


def test_greedy_tokens_through_the_engine(checkpoint):
    _, path = checkpoint
    prompts = random_prompts(512, (4, 17), seed=5)
    model = reference(path)
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
            )
        want.append(out[0, len(ids) :].tolist())
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=32, max_model_len=128)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want


def test_other_vision_language_models_are_still_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2VLForConditionalGeneration"],
                "model_type": "qwen2_vl",
                "vision_config": {"depth": 1},
            }
        )
    )
    with pytest.raises(
        ValueError,
        match="Qwen2VLForConditionalGeneration is not supported.*the text model of Gemma3ForConditionalGeneration",
    ):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_mistral_small_4_runs_its_mla_text_model(tmp_path):
    """Mistral Small 4 (Mistral3ForConditionalGeneration around a Mistral 4 text model): the
    MLA text model is loaded, and answers as the whole model on text."""
    mla = dict(
        TEXT, num_key_value_heads=4, head_dim=24, intermediate_size=96, moe_intermediate_size=32,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=4, num_experts_per_tok=2, model_type="mistral4",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
                         "partial_rotary_factor": 8 / 24},
    )  # fmt: skip
    config = Mistral3Config(
        text_config=mla,
        vision_config={**VISION, "model_type": "pixtral", "image_size": 28, "patch_size": 14},
        tie_word_embeddings=False,
    )
    model = Mistral3ForConditionalGeneration(config)
    randomize_weights(model, seed=4)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == "Mistral4ForCausalLM" and loaded.config.is_latent
    ids = random_prompts(512, (45,), seed=4)[0]  # past the original 32 positions
    with torch.no_grad():
        want = reference(tmp_path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 7), want, atol=1e-4, rtol=0)
