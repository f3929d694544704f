"""What a quantized linear layer is, independent of the file format it came from.

Four schemes cover the supported formats:

- `Fp8W8A8`: FP8 E4M3 weights [N, K] with a float32 scale per output channel (or one per
  tensor) and FP8 activations, scaled per token on the fly (dynamic) or by one static scale.
- `Fp8BlockW8A8`: FP8 E4M3 weights [N, K] with a float32 scale per [block_n, block_k] tile
  ([ceil(N / block_n), ceil(K / block_k)] scales) and FP8 activations scaled on the fly per
  token and group of block_k along K (DeepSeek-V3's and Qwen3-*-FP8's layout,
  compressed-tensors' FP8_BLOCK): each K block of the GEMM then has one scale per row of A and
  one per column tile of B.
- `Int8W8A8`: int8 weights [N, K], a float32 scale per output channel, int8 activations scaled
  symmetrically per token on the fly.
- `WNA16`: 4- or 8-bit integer weights, float activations, one scale (and zero point) per group
  of `group_size` input rows; act-order checkpoints map each input row to its group (g_idx).

`QuantConfig` maps layer names to schemes: what detect.py reads from config.json.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class UnsupportedQuantization(ValueError):
    """A checkpoint (or a `quantization=` choice) the engine cannot run correctly."""


@dataclass(frozen=True)
class Fp8W8A8:
    per_channel_weights: bool = True  # False: one scale for the whole weight
    static_input_scale: bool = False  # True: the checkpoint's input_scale; False: per token


@dataclass(frozen=True)
class Fp8BlockW8A8:
    block_n: int  # weight rows (output channels) per scale tile
    block_k: int  # weight columns per scale tile, and activation values per group

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_k < 1:
            raise ValueError(
                f"FP8 weight blocks must be positive, got [{self.block_n}, {self.block_k}]"
            )


@dataclass(frozen=True)
class Int8W8A8:
    """Per-channel weight scales, dynamic symmetric per-token activations."""


@dataclass(frozen=True)
class WNA16:
    bits: int  # 4 or 8
    group_size: int | None  # None: one group over all of K (per-channel scales)
    symmetric: bool  # False: the checkpoint stores zero points
    act_order: bool = False  # True: the checkpoint stores g_idx

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights are not supported; supported: 4 and 8")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None, got {self.group_size}")


LinearScheme = Fp8W8A8 | Fp8BlockW8A8 | Int8W8A8 | WNA16

# The file layouts a scheme's tensors may come in (each has its converter).
FORMATS = ("compressed-tensors", "fp8", "gptq", "gptq_v2", "awq", "online-fp8", "mxfp4")


@dataclass(frozen=True)
class LayerRule:
    """Layers matched by `targets` get `scheme`. A target is a module class name ("Linear"), a
    layer name, or "re:" followed by a regular expression over layer names."""

    targets: tuple[str, ...]
    scheme: LinearScheme


@dataclass(frozen=True)
class QuantConfig:
    """The quantization of one checkpoint: its method and format, a scheme per layer (rules;
    a layer several match takes its most specific target's, see scheme_for), and the layers
    kept in float (`ignore`, same target syntax).

    `kv_cache_scheme` is the checkpoint's KV-cache quantization (compressed-tensors'
    QuantizationArgs with its defaults filled in, or None), for the KV cache (kv_cache.py)."""

    method: str  # "compressed-tensors", "fp8", "gptq", "awq" (as config.json names it)
    format: str  # one of FORMATS: how the tensors are laid out on disk
    rules: tuple[LayerRule, ...]
    ignore: tuple[str, ...] = ()
    kv_cache_scheme: dict | None = field(default=None, compare=False)

    def scheme_for(self, layer: str) -> LinearScheme | None:
        """The scheme of the nn.Linear named `layer` (e.g. "model.layers.0.mlp.up_proj"), or
        None when it stays in float.

        A layer several rules match gets the scheme of its most specific target, as
        compressed-tensors picks it: a layer name before a "re:" pattern before the class
        "Linear", ties broken by the target's text; a target repeated in a later rule takes
        that rule's scheme."""
        if any(_matches(t, layer) for t in self.ignore):
            return None
        by_target = {t: rule.scheme for rule in self.rules for t in rule.targets}
        matched = [t for t in by_target if _matches(t, layer)]
        if not matched:
            return None
        return by_target[min(matched, key=_specificity)]


def _specificity(target: str) -> tuple[int, str]:
    if target == "Linear":
        return 2, target
    return (1 if target.startswith("re:") else 0), target


def _matches(target: str, layer: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    if target == "Linear":
        return True  # only nn.Linear layers are ever asked about
    return layer == target or layer.endswith("." + target)
