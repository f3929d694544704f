"""One linear layer's tensors as a checkpoint stores them, checked against what a format
expects: a tensor missing, an extra one, a wrong dtype or shape is an error that names the
layer, the format and what was found, so a checkpoint read by the wrong converter fails at
load instead of answering garbage."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CheckpointFormatError(ValueError):
    """A layer's tensors do not fit the format config.json names."""


class LayerTensors:
    """The tensors named `{layer}.{suffix}` of a checkpoint, keyed by suffix."""

    def __init__(self, layer: str, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
        self.layer, self.fmt, self.tensors = layer, fmt, tensors

    def expect(self, required: Iterable[str], optional: Iterable[str] = ()) -> None:
        """Exactly `required`, plus any of `optional` (bias is always optional)."""
        required, allowed = set(required), set(required) | set(optional) | {"bias"}
        found = set(self.tensors)
        missing, extra = sorted(required - found), sorted(found - allowed)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected {', '.join(extra)}")
            raise self.error(
                f"{'; '.join(parts)} (found {', '.join(sorted(found)) or 'nothing'}; "
                f"{self.fmt} needs {', '.join(sorted(required))})"
            )

    def get(self, name: str, dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
        t = self.tensors[name]
        if dtypes is not None and t.dtype not in dtypes:
            wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise self.error(f"{name} is {str(t.dtype).removeprefix('torch.')}, not {wanted}")
        return t

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def check_shape(self, name: str, shape: tuple[int, ...], tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise self.error(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")

    def error(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"layer {self.layer} is not a {self.fmt} layer: {why}")
