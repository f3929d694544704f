"""GGUF hyperparameters that transformers' reader leaves out: refuse such a file by name.

The engine reads GGUF files through transformers, which builds the config from a table of
llama.cpp metadata keys per architecture (transformers/integrations/ggml.py) and keeps its config
class's defaults for every key the table lacks. For Phi-3 and the Gemmas, llama.cpp's converter
writes some hyperparameters that table does not read, so a file that states a non-default value
loads, in transformers and so in the engine, as a different model than the one it was converted
from (other positions, other attention, other logits) without a word. This module compares what
the file states with the config transformers built and fails naming each difference, before any
weight is read.

Checked: Phi-3's LongRoPE (the rope_factors_long/short tensors), its rotary dimensions (a
partial rotary factor, as Phi-4-mini's) and its sliding window (Phi-3-mini's 2047); Gemma 2's
two soft-caps; Gemma 3's linear RoPE factor on the global layers (Gemma 3 4B and larger) and its
final soft-cap. Not checkable: Gemma's query_pre_attn_scalar, which the file does not state
(transformers assumes 256, right for Gemma 2 2B / 9B and Gemma 3, not for Gemma 2 27B's 144).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufFile:
    """What the checks read: the metadata (values as Python scalars) and the tensor names."""

    architecture: str
    metadata: dict[str, object]
    tensor_names: frozenset[str]

    @classmethod
    def read(cls, path: Path) -> GgufFile:
        # imported here, when a GGUF file is read: the H200 image has no gguf package and
        # every engine import must work there (scripts/h200_image)
        import gguf

        reader = gguf.GGUFReader(str(path))
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("tokenizer.")  # the vocabulary: large, and not checked here
        }
        return cls(
            str(metadata["general.architecture"]),
            metadata,
            frozenset(t.name for t in reader.tensors),
        )

    def get(self, key: str):
        """The value of `<architecture>.<key>`, or None when the file does not state it."""
        return self.metadata.get(f"{self.architecture}.{key}")


Check = Callable[[GgufFile, object], list[str]]


def check_gguf_config(path: Path, hf_config) -> None:
    """Fail when the GGUF file at `path` states a hyperparameter that transformers' config for
    it (`hf_config`) does not carry; the error names each one and what transformers kept."""
    file = GgufFile.read(path)
    problems = [p for check in _CHECKS.get(file.architecture, ()) for p in check(file, hf_config)]
    if problems:
        raise ValueError(
            f"{path.name}: this {file.architecture} GGUF file states what transformers' GGUF "
            f"reader (which the engine loads GGUF files with) does not read: "
            f"{'; '.join(problems)}. Loaded, it would run a different model than the one the "
            "file was converted from; load that Hugging Face checkpoint instead"
        )


def _phi3(file: GgufFile, hf_config) -> list[str]:
    problems = []
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_factors_long.weight" in file.tensor_names and rope.get("rope_type") != "longrope":
        problems.append(
            "LongRoPE factors (tensors rope_factors_long/short, pretraining length "
            f"{file.get('rope.scaling.original_context_length')}), but transformers builds "
            f"rope_type {rope.get('rope_type')!r}"
        )
    rotary = file.get("rope.dimension_count")
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    read_rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rotary is not None and rotary != read_rotary:
        problems.append(
            f"phi3.rope.dimension_count = {rotary} rotary dimensions per head, but transformers "
            f"rotates {read_rotary} of {head_dim}"
        )
    window = file.get("attention.sliding_window")
    if window and window != getattr(hf_config, "sliding_window", None):
        problems.append(
            f"phi3.attention.sliding_window = {window}, but transformers builds "
            f"sliding_window = {getattr(hf_config, 'sliding_window', None)}"
        )
    return problems


def _soft_caps(*names: str) -> Check:
    def check(file: GgufFile, hf_config) -> list[str]:
        problems = []
        for name in names:
            stated, built = file.get(name), getattr(hf_config, name, None)
            if stated is not None and not _same(stated, built):
                problems.append(
                    f"{file.architecture}.{name} = {stated:g}, but transformers builds {built}"
                )
        return problems

    return check


def _gemma3_rope(file: GgufFile, hf_config) -> list[str]:
    if file.get("rope.scaling.type") != "linear":
        return []
    factor = file.get("rope.scaling.factor")
    built = (getattr(hf_config, "rope_parameters", None) or {}).get("full_attention", {})
    if built.get("rope_type") == "linear" and _same(factor, built.get("factor")):
        return []
    return [
        f"gemma3.rope.scaling.type = linear with factor {factor:g} on the global layers, but "
        f"transformers builds rope_type {built.get('rope_type')!r} there"
    ]


def _same(stated: float, built: float | None) -> bool:
    """Equal up to the float32 the file stores."""
    return built is not None and abs(float(stated) - float(built)) <= 1e-6 * abs(float(built))


_CHECKS: dict[str, tuple[Check, ...]] = {
    "phi3": (_phi3,),
    "gemma2": (_soft_caps("attn_logit_softcapping", "final_logit_softcapping"),),
    "gemma3": (_gemma3_rope, _soft_caps("final_logit_softcapping")),
}
