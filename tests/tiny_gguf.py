"""Tiny GGUF files of Qwen3 and Qwen3-MoE, written from a tiny Hugging Face checkpoint.

llama.cpp's converter is not a Python package, so this writes what it would for these two
architectures with the gguf package: llama.cpp's metadata keys, its tensor names (experts
stacked as ffn_{gate,up,down}_exps), float32 tensors, and a byte-level BPE vocabulary of the
checkpoint's size (the 256 byte symbols, one merge, filler tokens) so that transformers can
build a tokenizer from the file, as the engine's GGUF loader asks it to.

transformers' GGUF reader takes neither head_dim nor the experts' intermediate size from the
file (it keeps Qwen3Config's head_dim 128 and Qwen3MoeConfig's moe_intermediate_size 768, the
values of the released models), so checkpoints written here must have those values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.tiny_models import BOS, EOS, randomize_weights, tiny_config

GGUF_KINDS = ("qwen3", "qwen3-moe")

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # the MoE router
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def build_tiny_gguf(kind: str, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random `kind` (see GGUF_KINDS) saved both as a Hugging Face folder and as a
    GGUF file in `folder`: (hf_folder, gguf_path). The shapes are tests.tiny_models' with
    head_dim 128 and, for Qwen3-MoE, experts of intermediate size 768 on every layer (see the
    module docstring)."""
    if kind not in GGUF_KINDS:
        raise ValueError(f"no tiny GGUF of {kind!r}; expected one of {', '.join(GGUF_KINDS)}")
    config = tiny_config(kind)
    config.head_dim = 128
    if kind == "qwen3-moe":
        config.moe_intermediate_size = 768
        config.mlp_only_layers = []
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 1000 + seed * len(GGUF_KINDS) + GGUF_KINDS.index(kind))
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    hf_folder = Path(folder) / "hf"
    model.save_pretrained(hf_folder)
    return hf_folder, write_tiny_gguf(hf_folder, Path(folder) / f"{kind}.gguf")


def write_tiny_gguf(hf_folder: Path, path: Path) -> Path:
    """Write the checkpoint in `hf_folder` (model_type qwen3 or qwen3_moe) as the GGUF `path`."""
    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = _ARCH[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_vocabulary(writer, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    for name, tensor in sorted(
        _gguf_tensors(load_file(str(Path(hf_folder) / "model.safetensors")))
    ):
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer, vocab_size: int, bos: int, eos: int) -> None:
    symbols = list(bytes_to_unicode().values())  # the 256 byte-level symbols
    tokens = symbols + ["ab"] + [f"<filler{i}>" for i in range(vocab_size - len(symbols) - 1)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)


def _gguf_tensors(state_dict: dict[str, torch.Tensor]):
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = tensor
        elif name == "model.embed_tokens.weight":
            yield "token_embd.weight", tensor
        elif name == "model.norm.weight":
            yield "output_norm.weight", tensor
        elif name == "lm_head.weight":
            yield "output.weight", tensor
        else:
            _, _, layer, *module, leaf = name.split(".")
            yield f"blk.{layer}.{_LAYER_TENSORS['.'.join(module)]}.{leaf}", tensor
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        yield f"blk.{layer}.ffn_{proj}_exps.weight", stacked
