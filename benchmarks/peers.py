"""The engines a benchmark compares: kvbatch itself and its peers, behind one small contract.

Each engine is a `Peer` subclass registered by name. The harness drives every peer the same
way, one after the other in one process:

    peer = make_peer(name, model_path, options)
    peer.load()          # not timed
    peer.warmup()        # not timed: a tiny job, so lazy initialisation is not measured
    result = peer.run(prompts, max_tokens)   # timed: generate() alone
    peer.close()         # frees the model before the next engine loads

Adding an engine (e.g. transformers' `generate_batch` as `hf-cb`) is one subclass that
implements `load` and `generate`, decorated with `@register_peer`.
"""

from __future__ import annotations

import gc
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WARMUP_PROMPT_LEN = 8
"""Warm-up prompts are shorter than one KV block, so they put nothing in kvbatch's prefix cache
(and nothing in its hit-rate counters) that the timed run could find."""


@dataclass(frozen=True)
class EngineOptions:
    """What every engine runs with; the kvbatch fields pass straight through to `engine.LLM`."""

    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the engine's default
    block_size: int = 16
    enable_prefix_caching: bool = True
    hf_batch_size: int | None = None  # hf-static: requests per static batch; None = all

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.hf_batch_size is not None and self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size must be >= 1, got {self.hf_batch_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class RunResult:
    """One timed run of one engine over a whole workload."""

    engine: str
    seconds: float
    output_tokens: int
    num_requests: int
    token_ids: list[list[int]] = field(repr=False)  # per request, in input order
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")


class Peer(ABC):
    """One engine under test. Subclasses set `name` and implement `load` and `generate`.

    Contract: `load` must be called before `warmup`/`run`; `generate` returns, for each prompt
    in input order, exactly the token ids the engine decoded (greedy, `max_tokens` of them,
    EOS ignored); `run` times `generate` alone; `close` drops every reference to the model.
    """

    name: ClassVar[str]

    def __init__(self, model_path: str | Path, options: EngineOptions) -> None:
        self.model_path = str(model_path)
        self.options = options

    @abstractmethod
    def load(self) -> None:
        """Load weights and build the engine (not timed)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy-decode exactly `max_tokens` tokens for every prompt."""

    def run_extra(self, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
        """Engine-specific figures about the last `generate` (e.g. prefix-cache hits)."""
        return {}

    def before_run(self) -> None:
        """Called just before the timed `generate` (not timed): e.g. to snapshot counters."""
        return None

    def warmup(self) -> None:
        """A tiny untimed job so that one-off costs (threads, allocator, lazy init) are paid."""
        self.generate([[5 + i] * WARMUP_PROMPT_LEN for i in range(2)], max_tokens=2)

    def run(self, prompts: list[list[int]], max_tokens: int) -> RunResult:
        """Time `generate` over `prompts` and count the tokens it produced."""
        self.before_run()
        self._synchronize()
        start = time.perf_counter()
        outputs = self.generate(prompts, max_tokens)
        self._synchronize()
        seconds = time.perf_counter() - start
        return RunResult(
            engine=self.name,
            seconds=seconds,
            output_tokens=sum(len(o) for o in outputs),
            num_requests=len(prompts),
            token_ids=outputs,
            extra=self.run_extra(prompts, outputs),
        )

    def close(self) -> None:
        """Free the model so the next engine loads into clean memory."""
        for attr in list(vars(self)):
            if attr not in ("model_path", "options", "name"):
                setattr(self, attr, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _synchronize(self) -> None:
        if self.options.device.startswith("cuda"):
            torch.cuda.synchronize()


PEERS: dict[str, type[Peer]] = {}
"""Registry by name: the names `kvbatch bench --peers` accepts."""


def register_peer(cls: type[Peer]) -> type[Peer]:
    """Class decorator: make `cls` available under `cls.name`."""
    if cls.name in PEERS:
        raise ValueError(f"peer {cls.name!r} is already registered")
    PEERS[cls.name] = cls
    return cls


def make_peer(name: str, model_path: str | Path, options: EngineOptions) -> Peer:
    """A new, unloaded engine of the registered kind `name`."""
    try:
        cls = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(PEERS))}") from None
    return cls(model_path, options)


@register_peer
class KvbatchPeer(Peer):
    """kvbatch's own engine through its public API (`engine.LLM`)."""

    name = "kvbatch"

    def load(self) -> None:
        from engine import LLM, SamplingParams  # the engine is imported only when benchmarked

        o = self.options
        self._sampling_params = SamplingParams
        self.llm = LLM(
            model=self.model_path,
            device=o.device,
            dtype=o.dtype,
            max_num_seqs=o.max_num_seqs,
            max_num_batched_tokens=o.max_num_batched_tokens,
            block_size=o.block_size,
            enable_prefix_caching=o.enable_prefix_caching,
        )
        self._cached_tokens: list[int] = []
        self._stats_before: dict[str, Any] = {}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self._cached_tokens = [int(o.num_cached_tokens or 0) for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]

    def before_run(self) -> None:
        self._stats_before = _plain(self.llm.stats())

    def run_extra(self, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts)
        cached = sum(self._cached_tokens)
        stats = self.llm.stats()
        after = _plain(stats)
        return {
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": cached,
            # prompt tokens whose KV came from the cache, from the request outputs
            "cached_token_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
            # the engine's counters over this run alone (warm-up and earlier repeats excluded)
            "prefix_hit_rate": _hit_rate_delta(self._stats_before, after),
            # the engine's own figure, over the LLM's whole life
            "prefix_hit_rate_total": _float_or_none(getattr(stats, "prefix_hit_rate", None)),
            "stats": after,
        }


@register_peer
class HFStaticPeer(Peer):
    """transformers `generate` (SDPA attention) in static batches: the baseline to beat.

    Prompts of unequal length in one batch are left-padded with an attention mask. EOS is
    ignored by passing `eos_token_id=None` to `generate` (which then neither stops at EOS nor
    masks it, like vLLM's `ignore_eos`); `min_new_tokens` would mask EOS and so change greedy
    tokens.
    """

    name = "hf-static"

    def load(self) -> None:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": self.options.torch_dtype, "attn_implementation": "sdpa"}
        path = Path(self.model_path)
        if path.suffix == ".gguf":
            source, kwargs["gguf_file"] = str(path.parent), path.name
        else:
            source = str(path)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        self.model = model.to(self.options.device).eval()
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = model.config.pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        batch_size = self.options.hf_batch_size or len(prompts)
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            outputs += self._generate_batch(prompts[start : start + batch_size], max_tokens)
        return outputs

    def _generate_batch(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column `width`
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
        device = self.options.device
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=None,
                pad_token_id=self.pad_token_id,
            )
        new = out[:, width:].tolist()  # [batch, max_tokens]
        if any(len(row) != max_tokens for row in new):
            raise RuntimeError(f"hf-static decoded {len(new[0])} tokens, expected {max_tokens}")
        return new


def _plain(obj: Any) -> dict[str, Any]:
    """A stats object as a JSON-friendly dict (numbers, strings, bools and None only)."""
    if hasattr(obj, "_asdict"):
        items = obj._asdict()
    elif isinstance(obj, dict):
        items = obj
    elif hasattr(obj, "__dataclass_fields__"):
        items = {f: getattr(obj, f) for f in obj.__dataclass_fields__}
    else:
        try:
            items = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        except TypeError:  # no __dict__ (slots, None)
            items = {}
    return {k: v for k, v in items.items() if v is None or isinstance(v, (bool, int, float, str))}


def _hit_rate_delta(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """prefix_hits / prefix_queries between two stats snapshots; None if the engine has no
    such counters or made no query."""
    keys = ("prefix_hits", "prefix_queries")
    if not all(isinstance(d.get(k), int) for d in (before, after) for k in keys):
        return None
    queries = after["prefix_queries"] - before["prefix_queries"]
    hits = after["prefix_hits"] - before["prefix_hits"]
    return hits / queries if queries > 0 else None


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)
