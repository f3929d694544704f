"""Benchmark workloads: each is data (a shape and a seed), never a code path of its own.

A RAG-shaped prompt is three parts, drawn from a seeded generator so that every engine sees
the same token ids:

    [ document (shared by the document's chunks) | chunk (unique) | instruction (shared by all) ]

The instruction comes last, so the only prefix two prompts share is their document: a prefix
cache can skip the document for all but the first chunk of each document. With `shared=False`
every prompt is unique random tokens of the same length, so caching cannot help at all (the
`no-share` row of docs/BENCHMARKS.md: it shows there is no regression where caching is useless).

Prompts come document by document (document 0's chunks, then document 1's, ...), in the
order a job would hand them to the engine after prefix grouping.

A workload with `long_prompt_len > 0` (`long-prefill`) adds one long prompt mid-run: the
requests above start decoding, and once each has produced `long_prompt_after` tokens the long
prompt arrives. What it measures is the longest wait between two tokens of any decoding
request while the long prompt is prefilled (chunked prefill keeps it short).

The GPU workloads run on random-weight models of real shapes (bench/models.py:
Llama-3.2-1B for most, Llama-3.1-8B's, Qwen3-30B-A3B's and Qwen3-8B's layers for the rest);
each has a tiny variant (`get_workload(name, tiny=True)`, `kvbatch bench NAME --tiny`) of the
same structure on a tiny model, so the same code path runs on the CPU in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

FIRST_ORDINARY_TOKEN = 3
"""Token ids below this are special (unk/pad, bos, eos in Llama-family vocabularies)."""

SMOLLM2 = "smollm2-135m-instruct"
"""Real SmolLM2-135M-Instruct weights (kvbatch.fetch.smollm2_dir()), for CPU workloads."""

LLAMA_1B_RANDOM = "llama-3.2-1b-random"
"""Llama-3.2-1B shape with random weights (kvbatch.bench.models.LLAMA_3_2_1B), for the GPU
workloads (`rag`, `no-share-gpu`, `long-prefill`)."""

LLAMA_8B_RANDOM = "llama-3.1-8b-8-layers-random"
"""Llama-3.1-8B's layer shapes, 8 layers, random weights (kvbatch.bench.models), for
`decode-small-batch`."""

QWEN3_MOE_RANDOM = "qwen3-30b-a3b-4-layers-random"
"""Qwen3-30B-A3B's layer shapes, 4 layers, random weights (kvbatch.bench.models), for
`rag-moe`."""

QWEN3_8B_RANDOM = "qwen3-8b-8-layers-random"
"""Qwen3-8B's layer shapes, 8 of its 36 layers, random weights (kvbatch.bench.models), for
`rag-qwen3`."""

TINY_RANDOM = "llama-tiny-random"
"""The same architecture shrunk (kvbatch.bench.models.TINY_LLAMA), for the `--tiny` variants."""

TINY_MOE_RANDOM = "qwen3-moe-tiny-random"
"""Qwen3-MoE shrunk (kvbatch.bench.models.TINY_QWEN3_MOE), for `rag-moe --tiny`."""

TINY_QWEN3_RANDOM = "qwen3-tiny-random"
"""Dense Qwen3 shrunk (kvbatch.bench.models.TINY_QWEN3), for `rag-qwen3 --tiny`."""

GPT_OSS_RANDOM = "gpt-oss-20b-4-layers-random"
"""gpt-oss-20b's layer shapes, 4 of 24 layers, random MXFP4 experts (kvbatch.bench.models),
for `rag-gpt-oss`."""

TINY_GPT_OSS_RANDOM = "gpt-oss-tiny-random"
"""gpt-oss shrunk, MXFP4 experts (kvbatch.bench.models.TINY_GPT_OSS), for `rag-gpt-oss --tiny`."""

WEIGHT_FORMATS = ("float", "w4a16", "fp8-block", "mxfp4")
"""A random model's weights: float, rounded to 4 bits (kvbatch.bench.rtn_w4a16), FP8 with
block scales (kvbatch.bench.fp8_block), or MXFP4 experts (gpt-oss specs, whose default it is:
`--weights float` leaves a spec's own format)."""

RANDOM_MODELS = (
    LLAMA_1B_RANDOM,
    LLAMA_8B_RANDOM,
    QWEN3_MOE_RANDOM,
    QWEN3_8B_RANDOM,
    TINY_RANDOM,
    TINY_MOE_RANDOM,
    TINY_QWEN3_RANDOM,
    GPT_OSS_RANDOM,
    TINY_GPT_OSS_RANDOM,
)
"""The models built from a shape with random weights (kvbatch.bench.models.random_model_dir)."""


@dataclass(frozen=True)
class Workload:
    """One benchmark job: `num_documents x chunks_per_document` requests of equal length.

    `model` names which weights the workload runs on (one of the constants above); `dtype` and
    `device` are what the row of docs/BENCHMARKS.md measured, and the CLI may override them.
    """

    name: str
    model: str
    num_documents: int
    chunks_per_document: int
    document_len: int
    chunk_len: int
    instruction_len: int
    output_len: int
    shared: bool = True
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    description: str = ""
    hf_batch_size: int | None = None  # hf-static's requests per static batch (None: all)
    # long-prefill: one prompt of this many tokens arrives once every request above has
    # decoded `long_prompt_after` tokens; it decodes `long_output_len` tokens itself
    long_prompt_len: int = 0
    long_prompt_after: int = 0
    long_output_len: int = 1
    # the hardware floor of this job (docs/BENCHMARKS.md), on a device whose name
    # contains `floor_device`; None where no floor was worked out
    floor_seconds: float | None = None
    floor_device: str = "H200"

    def __post_init__(self) -> None:
        counts = ("num_documents", "chunks_per_document", "output_len")
        lengths = ("document_len", "chunk_len", "instruction_len")
        for field in counts:
            if getattr(self, field) < 1:
                raise ValueError(f"workload {self.name!r}: {field} must be >= 1")
        for field in lengths:
            if getattr(self, field) < 0:
                raise ValueError(f"workload {self.name!r}: {field} must be >= 0")
        if self.prompt_len < 1:
            raise ValueError(f"workload {self.name!r}: prompts would be empty")
        if self.long_prompt_len < 0 or self.long_prompt_after < 0 or self.long_output_len < 1:
            raise ValueError(f"workload {self.name!r}: bad long-prompt settings")
        if self.long_prompt_len and self.long_prompt_after >= self.output_len:
            raise ValueError(
                f"workload {self.name!r}: long_prompt_after must be < output_len "
                "(the long prompt must arrive while the others still decode)"
            )
        if self.hf_batch_size is not None and self.hf_batch_size < 1:
            raise ValueError(f"workload {self.name!r}: hf_batch_size must be >= 1")

    @property
    def has_long_prompt(self) -> bool:
        return self.long_prompt_len > 0

    @property
    def num_requests(self) -> int:
        return self.num_documents * self.chunks_per_document

    @property
    def prompt_len(self) -> int:
        return self.document_len + self.chunk_len + self.instruction_len

    @property
    def output_tokens(self) -> int:
        """Output tokens of the whole job (every request decodes exactly `output_len`)."""
        return self.num_requests * self.output_len

    def with_seed(self, seed: int) -> Workload:
        """The same shape with other token ids (e.g. one draw per repeat of a benchmark)."""
        return dataclasses.replace(self, seed=seed)

    def summary(self) -> str:
        """One line for the top of a results table."""
        if self.has_long_prompt:
            return (
                f"{self.name}: {self.num_requests} requests decoding {self.output_len} tokens "
                f"(prompts of {self.prompt_len}), plus one {self.long_prompt_len}-token prompt "
                f"arriving after {self.long_prompt_after} tokens, model {self.model}, {self.dtype}"
            )
        kind = "shared documents" if self.shared else "no shared prefix"
        return (
            f"{self.name}: {self.num_requests} requests = {self.num_documents} documents x "
            f"{self.chunks_per_document} chunks, prompt {self.prompt_len} = "
            f"{self.document_len} + {self.chunk_len} + {self.instruction_len} tokens "
            f"({kind}), output {self.output_len} tokens, model {self.model}, {self.dtype}"
        )

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = dataclasses.asdict(self)
        d.update(
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_tokens=self.output_tokens,
        )
        return d


def make_prompts(workload: Workload, vocab_size: int) -> list[list[int]]:
    """The workload's prompts as token ids in [3, vocab_size), the same for the same seed."""
    if vocab_size <= FIRST_ORDINARY_TOKEN + 1:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_TOKEN + 1}, got {vocab_size}")
    rng = np.random.default_rng(workload.seed)

    def draw(n: int) -> list[int]:
        return rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n).tolist()

    if not workload.shared:
        return [draw(workload.prompt_len) for _ in range(workload.num_requests)]

    instruction = draw(workload.instruction_len)
    prompts = []
    for _ in range(workload.num_documents):
        document = draw(workload.document_len)
        for _ in range(workload.chunks_per_document):
            prompts.append(document + draw(workload.chunk_len) + instruction)
    return prompts


def make_long_prompt(workload: Workload, vocab_size: int) -> list[int]:
    """The long-prefill workload's long prompt: unique tokens from a generator of its own, so
    it shares nothing with `make_prompts`' prompts and does not change them."""
    if not workload.has_long_prompt:
        raise ValueError(f"workload {workload.name!r} has no long prompt")
    rng = np.random.default_rng([workload.seed, 1])
    return rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=workload.long_prompt_len).tolist()


_RAG_CPU = Workload(
    name="rag-cpu",
    model=SMOLLM2,
    num_documents=4,
    chunks_per_document=8,
    document_len=384,
    chunk_len=64,
    instruction_len=16,
    output_len=32,
    description="prefix reuse and batch throughput on the CPU",
)

_RAG = Workload(
    name="rag",
    model=LLAMA_1B_RANDOM,
    num_documents=16,
    chunks_per_document=32,
    document_len=1024,
    chunk_len=128,
    instruction_len=32,
    output_len=64,
    dtype="bfloat16",
    device="cuda",
    hf_batch_size=64,
    floor_seconds=0.4,
    description="prefix reuse and batch throughput on the GPU",
)

_NO_SHARE_GPU = dataclasses.replace(
    _RAG,
    name="no-share-gpu",
    shared=False,
    floor_seconds=None,
    description="unique prompts of rag's shape: no regression where caching is useless",
)

_LONG_PREFILL = Workload(
    name="long-prefill",
    model=LLAMA_1B_RANDOM,
    num_documents=64,  # 64 decoding requests with unique 128-token prompts
    chunks_per_document=1,
    document_len=0,
    chunk_len=128,
    instruction_len=0,
    # the decoders outlast the long prompt's prefill: in chunks sized to ~2.5 plain steps a
    # 32k prompt takes a few hundred steps
    output_len=512,
    shared=False,
    dtype="bfloat16",
    device="cuda",
    long_prompt_len=32768,
    long_prompt_after=16,
    long_output_len=8,
    description="chunked prefill: the longest token gap of decoding requests",
)

_DECODE_SMALL_BATCH = Workload(
    name="decode-small-batch",
    model=LLAMA_8B_RANDOM,
    num_documents=8,  # 8 requests: run with --max-num-seqs 1 to 8 for batch 1 to 8
    chunks_per_document=1,
    document_len=0,
    chunk_len=128,
    instruction_len=0,
    output_len=256,
    shared=False,
    dtype="bfloat16",
    device="cuda",
    description="memory-bound decode at batch 1 to 8 (--max-num-seqs): the weights' bytes "
    "per step, bfloat16 against W4A16 (--weights w4a16) and FP8 (--quantization fp8)",
)

_RAG_MOE = dataclasses.replace(
    _RAG,
    name="rag-moe",
    model=QWEN3_MOE_RANDOM,
    num_documents=8,
    chunks_per_document=16,
    floor_seconds=None,
    description="rag's prompts (8 documents x 16 chunks) on Qwen3-30B-A3B's layers (4 of 48): "
    "the fused MoE kernel against transformers' static generate",
)

# rag-moe's requests, not rag's 512: the dense and the MoE model answer the same prompts, and
# transformers' two static batches of the 2.8 B-parameter model fit the optional step's limit
_RAG_QWEN3 = dataclasses.replace(
    _RAG_MOE,
    name="rag-qwen3",
    model=QWEN3_8B_RANDOM,
    description="rag's prompts (8 documents x 16 chunks, as rag-moe) on Qwen3-8B's layers "
    "(8 of 36): the dense path at a realistic size against transformers' static generate",
)

_RAG_GPT_OSS = dataclasses.replace(
    _RAG_MOE,
    name="rag-gpt-oss",
    model=GPT_OSS_RANDOM,
    description="rag's prompts (8 documents x 16 chunks, as rag-moe) on gpt-oss-20b's layers "
    "(4 of 24) with random MXFP4 experts: sink attention, 128-token windows and the MXFP4 MoE "
    "kernel against transformers' static generate (its MXFP4 dequantized to bfloat16)",
)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        _RAG_CPU,
        dataclasses.replace(
            _RAG_CPU,
            name="no-share",
            shared=False,
            description="unique prompts of rag-cpu's shape: no regression where caching is useless",
        ),
        _RAG,
        _NO_SHARE_GPU,
        _LONG_PREFILL,
        _DECODE_SMALL_BATCH,
        _RAG_MOE,
        _RAG_QWEN3,
        _RAG_GPT_OSS,
    )
}
"""Registry by name (`kvbatch bench NAME`)."""

_TINY_RAG = dataclasses.replace(
    _RAG,
    name="rag-tiny",
    model=TINY_RANDOM,
    num_documents=4,
    chunks_per_document=4,
    document_len=64,
    chunk_len=16,
    instruction_len=8,
    output_len=8,
    dtype="float32",
    device="cpu",
    hf_batch_size=8,
    floor_seconds=None,
    description="rag's structure on the tiny model, for the CPU",
)

TINY_WORKLOADS: dict[str, Workload] = {
    "rag": _TINY_RAG,
    "no-share-gpu": dataclasses.replace(
        _TINY_RAG,
        name="no-share-gpu-tiny",
        shared=False,
        description="no-share-gpu's structure on the tiny model, for the CPU",
    ),
    "long-prefill": dataclasses.replace(
        _LONG_PREFILL,
        name="long-prefill-tiny",
        model=TINY_RANDOM,
        num_documents=8,
        chunk_len=32,
        output_len=48,
        dtype="float32",
        device="cpu",
        long_prompt_len=2048,
        long_prompt_after=8,
        long_output_len=4,
        description="long-prefill's structure on the tiny model, for the CPU",
    ),
    "rag-moe": dataclasses.replace(
        _TINY_RAG,
        name="rag-moe-tiny",
        model=TINY_MOE_RANDOM,
        description="rag-moe's structure on a tiny Qwen3-MoE, for the CPU",
    ),
    "rag-qwen3": dataclasses.replace(
        _TINY_RAG,
        name="rag-qwen3-tiny",
        model=TINY_QWEN3_RANDOM,
        description="rag-qwen3's structure on a tiny dense Qwen3, for the CPU",
    ),
    "rag-gpt-oss": dataclasses.replace(
        _TINY_RAG,
        name="rag-gpt-oss-tiny",
        model=TINY_GPT_OSS_RANDOM,
        description="rag-gpt-oss's structure on a tiny gpt-oss with MXFP4 experts, for the CPU",
    ),
    "decode-small-batch": dataclasses.replace(
        _DECODE_SMALL_BATCH,
        name="decode-small-batch-tiny",
        model=TINY_RANDOM,
        chunk_len=16,
        output_len=16,
        dtype="float32",
        device="cpu",
        description="decode-small-batch's structure on the tiny model, for the CPU",
    ),
}
"""The `--tiny` variant of each GPU workload: the same structure on the tiny model, float32 on
the CPU, small enough for tests and for a CPU trial of scripts/gpu-check.sh."""


def get_workload(name: str, tiny: bool = False) -> Workload:
    """The registered workload `name` (its tiny variant with `tiny`); errors list the names."""
    if tiny:
        if name in TINY_WORKLOADS:
            return TINY_WORKLOADS[name]
        known = ", ".join(sorted(TINY_WORKLOADS))
        raise ValueError(f"workload {name!r} has no tiny variant; these do: {known}")
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; known: {known}") from None
