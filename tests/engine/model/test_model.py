"""Our forward against transformers' on the same weights: logits within 1e-4 (float32)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.kv.layer_tensors import layer_kv_tensors
from kvbatch.engine.model.loader import load_model
from tests.reference import hf_logits

KINDS = ["llama-gqa", "llama-mha", "llama3-rope", "qwen2", "mistral", "llama-sharded"]
BLOCK = 16


def prefill_logits(model, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Run a prompt through our model in chunks of `chunk` tokens over a paged cache whose
    blocks are deliberately out of order; return every position's logits."""
    cfg = model.config
    num_blocks = -(-len(token_ids) // BLOCK) + 3
    # each layer's own shape, KV-shared layers on their owner's (engine/kv/layer_tensors.py)
    caches = layer_kv_tensors(cfg, None, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    table = torch.tensor(list(reversed(range(num_blocks))))[: -(-len(token_ids) // BLOCK)]
    rows = []
    for start in range(0, len(token_ids), chunk):
        ids = torch.tensor(token_ids[start : start + chunk])
        pos = torch.arange(start, start + len(ids))
        slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        n_blocks = -(-(start + len(ids)) // BLOCK)
        meta = AttentionMetadata(
            slots,
            0,
            torch.zeros(0, 1, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            [PrefillSpan(0, len(ids), start + len(ids), table[:n_blocks])],
        )
        if len(ids) == 1:  # a single token takes the decode path
            meta = AttentionMetadata(
                slots, 1, table[:n_blocks][None], torch.tensor([start + 1]), []
            )
        rows.append(model(ids, pos, caches, meta, TorchAttentionBackend()))
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_models, kind):
    path = tiny_models(kind)
    model = load_model(path, torch.float32, torch.device("cpu")).model
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (53,), generator=g).tolist()
    ref = hf_logits(path, ids)
    for chunk in (53, 16, 7, 1):  # whole prompt, block-sized, odd chunks, token by token
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


def test_smollm2_logits_match_transformers(smollm2_dir):
    model = load_model(smollm2_dir, torch.float32, torch.device("cpu"))
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = hf_logits(smollm2_dir, ids)
    ours = prefill_logits(model.model, ids, 24)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, '
        '"n_layer": 1, "n_head": 2, "vocab_size": 10}'
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_model_path_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_weights_are_listed(tiny_models, tmp_path):
    import shutil

    src = tiny_models("llama-gqa")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 weights: model.norm.weight"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
