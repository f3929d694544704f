"""Write a gpt-oss checkpoint's experts in MXFP4, as OpenAI publishes gpt-oss: the packer for
test checkpoints and for `kvbatch bench`'s random gpt-oss-shaped models (no hub here).

transformers holds a float gpt-oss's experts as `gate_up_proj` [E, H, 2I] (interleaved gate and
up columns) and `down_proj` [E, I, H]; the published files hold each projection out-features
first, quantized along its input (kernels/mxfp4.py):

    gate_up_proj -> gate_up_proj_blocks [E, 2I, H / 32, 16], gate_up_proj_scales [E, 2I, H / 32]
    down_proj    -> down_proj_blocks    [E, H, I / 32, 16],  down_proj_scales    [E, H, I / 32]

Biases stay float. config.json gains the quantization_config gpt-oss ships with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvbatch.kernels.mxfp4 import quantize_mxfp4

MODULES_TO_NOT_CONVERT = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
}


def pack_mxfp4_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every stacked expert projection replaced by its blocks and scales."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            # transformers' [E, in, out] -> out features first, quantized along the input
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = tensor
    return out


def pack_mxfp4_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write `src`'s gpt-oss folder (safetensors, one file or shards) to `dst` (may be `src`)
    with MXFP4 experts, one model.safetensors, and the mxfp4 quantization_config."""
    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no .safetensors files")
    state_dict: dict[str, torch.Tensor] = {}
    for f in files:
        state_dict.update(load_file(f))
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(
            f"{src} is not a gpt-oss checkpoint (model_type {config.get('model_type')!r})"
        )
    packed = pack_mxfp4_state_dict(state_dict)
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f.parent == dst:
            f.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in packed.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if src != dst:
        for extra in src.iterdir():
            if (
                extra.suffix != ".safetensors"
                and extra.name
                not in (
                    "config.json",
                    "model.safetensors.index.json",
                )
                and extra.is_file()
            ):
                (dst / extra.name).write_bytes(extra.read_bytes())
    return dst
