"""Online FP8 (`quantization="fp8"`): per-channel FP8 weights computed at load, activations
quantized per token, embeddings and lm_head kept. On the real SmolLM2 its answers stay close
to float32's; the test prints the figures (docs) and asserts only a loose floor, so a broken
path fails while rounding noise does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.linear import Fp8Linear
from kvbatch.engine.quant.qdq import FP8_DTYPE
from tests.engine.model.test_model import prefill_logits
from tests.engine.quant.quality import agreement_on_text, tokens_before_divergence

TEXT = Path(__file__).parents[2] / "data" / "english_text.txt"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Why is the sky blue?",
]
MAX_TOKENS = 48


def test_online_fp8_quantizes_every_linear_but_embeddings_and_lm_head(tiny_models):
    path = tiny_models("llama-gqa")
    loaded = load_model(path, torch.float32, torch.device("cpu"), quantization="fp8")
    model, float_model = loaded.model, load_model(path, torch.float32, torch.device("cpu")).model
    assert loaded.quantization_method == "fp8"
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear) and q_proj.weight.dtype == FP8_DTYPE
    assert q_proj.weight_scale.shape == (q_proj.out_features, 1)  # per output channel
    assert q_proj.input_scale is None  # per token, at run time
    assert type(model.lm_head) is torch.nn.Linear
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # the answers follow the quantized weights: not float32's, but close to them
    ids = list(range(3, 60))
    ours, ref = prefill_logits(model, ids, 16), prefill_logits(float_model, ids, 16)
    assert not torch.allclose(ours, ref, atol=1e-4)
    torch.testing.assert_close(ours, ref, atol=1.0, rtol=0)
    # the weights shrink to a quarter (float32 -> one byte, plus a float32 scale a row)
    assert loaded.weight_bytes < load_model(path, torch.float32, torch.device("cpu")).weight_bytes


def test_online_fp8_on_smollm2_stays_close_to_float32(smollm2_dir):
    reference = LLM(
        model=str(smollm2_dir), device="cpu", max_model_len=2048, kv_cache_bytes=256 << 20
    )
    fp8 = LLM(
        model=str(smollm2_dir),
        device="cpu",
        max_model_len=2048,
        kv_cache_bytes=256 << 20,
        quantization="fp8",
    )
    assert fp8.stats().quantization == "fp8"
    assert fp8.stats().weight_bytes < 0.6 * reference.stats().weight_bytes
    tokenizer = reference.tokenizer
    ids = tokenizer.encode(TEXT.read_text())
    quality = agreement_on_text(reference.engine.model, fp8.engine.model, ids)

    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        )
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    shared = [tokens_before_divergence(a, b) for a, b in zip(want, got)]
    print(
        f"\nonline fp8 vs float32 on SmolLM2-135M ({len(ids)} tokens of text): "
        f"mean KL {quality.mean_kl:.4f} nats, top-1 agreement {quality.top1_agreement:.3f}, "
        f"perplexity {quality.perplexity:.3f} vs {quality.perplexity_ref:.3f}; greedy tokens "
        f"equal before divergence {shared} of {MAX_TOKENS}; weights "
        f"{fp8.stats().weight_bytes / 2**20:.1f} MiB vs {reference.stats().weight_bytes / 2**20:.1f}"
    )
    assert quality.mean_kl < 0.1
    assert quality.top1_agreement > 0.85
    assert quality.perplexity < 1.15 * quality.perplexity_ref
    assert max(shared) >= 8  # a broken path diverges at once everywhere


@pytest.mark.parametrize("quantization", ["int4", "gptq"])
def test_unknown_online_methods_are_refused(tiny_models, quantization):
    with pytest.raises(ValueError, match="supported.*fp8"):
        LLM(model=str(tiny_models("llama-gqa")), device="cpu", quantization=quantization)
