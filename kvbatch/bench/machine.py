"""What a benchmark's figures were measured on: devices, versions, threads (in every JSON)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def machine_info(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    import transformers

    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = _cpu_model() or platform.processor() or "unknown cpu"
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": device_name,
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
