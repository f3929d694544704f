"""The experts' gate when it is not plain SiLU-and-mul: gpt-oss's clamped SwiGLU.

    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

(transformers' GptOssExperts._apply_gate; alpha 1.702 and limit 7 in the published configs).
The clamps keep the product bounded whatever the router sends an expert. Computed in the
activations' dtype, as transformers does; a few elementwise ops on the [pairs, 2I] gate|up
rows, so plain torch serves the CPU and the GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClampedSwiGLU:
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
