"""The transformers peers: `hf-static` (generate in static batches, the baseline) and
`hf-cb` (transformers' own continuous batching, generate_batch).

Both are listed in kvbatch.bench.peers' registry; the contract they implement is in
kvbatch.bench.peer.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvbatch.bench.peer import Peer, PeerUnavailable, Timings


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
            kwargs.update(mxfp4_dequantized(path))
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except ValueError as e:  # gpt-oss (its sinks) and Gemma 2 have no SDPA path
            if "does not support an attention implementation" not in str(e):
                raise
            model = AutoModelForCausalLM.from_pretrained(
                source, **{**kwargs, "attn_implementation": "eager"}
            )
        self.model = model.to(self.options.device).eval()
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = model.config.pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        batch_size = self.options.hf_batch_size or len(prompts)
        outputs: list[list[int]] = []
        timings = Timings([], [])
        start = time.perf_counter()  # every request arrives at the start, as in kvbatch
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            clock = _StepClock(self.options.device)
            outputs += self._generate_batch(batch, max_tokens, clock)
            ttft, tpot = clock.ttft_tpot(start)
            timings.ttft += [ttft] * len(batch)
            timings.tpot += [tpot] * len(batch)
        self.timings = timings
        return outputs

    def _generate_batch(
        self, prompts: list[list[int]], max_tokens: int, clock: _StepClock | None = None
    ) -> list[list[int]]:
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
                **({} if clock is None else {"logits_processor": _logits_processors(clock)}),
            )
        new = out[:, width:].tolist()  # [batch, max_tokens]
        if any(len(row) != max_tokens for row in new):
            raise RuntimeError(f"hf-static decoded {len(new[0])} tokens, expected {max_tokens}")
        return new


class HFContinuousBatchingPeer(Peer):
    """transformers' own paged continuous batching, `model.generate_batch(...)`.

    Defaults as transformers chooses them on CUDA (its KV pool is sized from free memory); on
    the CPU the pool and batch are sized to the job, as the automatic sizing there takes all of
    the machine's memory. EOS is disabled with `eos_token_id=-1` in the generation config
    (transformers' own "no EOS" value). Token times come from `record_timestamps` where the
    installed transformers has it. A transformers without `generate_batch` makes this peer
    report itself unavailable (PeerUnavailable) instead of failing the whole run.

    The manager is kept between calls (`persistent_manager=True`): otherwise every call builds
    a new one inside the timed run, allocating its KV pool and, on CUDA, capturing its CUDA
    graphs, which a job of a million prompts pays once and kvbatch pays before timing. A kept
    manager stays sized for the call that made it (transformers' workload hints: requests per
    batch, blocks per request), so the tiny warm-up's is dropped and the workload's full
    warm-up run (on CUDA; harness.warm_up) makes the one the timed runs use.
    """

    name = "hf-cb"
    needs_full_warmup = True  # the manager, sized for the workload

    def load(self) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.options.torch_dtype, attn_implementation="sdpa"
        )
        if not callable(getattr(model, "generate_batch", None)):
            raise PeerUnavailable(
                f"transformers {transformers.__version__} has no generate_batch "
                "(continuous batching): hf-cb cannot run with it"
            )
        self.model = model.to(self.options.device).eval()
        self._signature = inspect.signature(self.model.generate_batch).parameters
        logging.getLogger("ContinuousBatchingLogger").addFilter(_KEPT_MANAGER_NOTICE)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        kwargs: dict[str, Any] = {}
        options = (
            ("progress_bar", False),
            ("record_timestamps", True),
            ("persistent_manager", True),
        )
        for name, value in options:
            if name in self._signature:
                kwargs[name] = value
        cb_config = self._cpu_cb_config(prompts, max_tokens)
        if cb_config is not None:
            kwargs["continuous_batching_config"] = cb_config
        start = time.perf_counter()
        try:
            results = self.model.generate_batch(prompts, generation_config=config, **kwargs)
        except TypeError as e:  # an API of another shape than the one this peer was written for
            import transformers

            raise PeerUnavailable(
                f"generate_batch of transformers {transformers.__version__} does not take "
                f"these arguments ({e})"
            ) from e
        ordered = _in_input_order(results, len(prompts))
        outputs, ttft, tpot = [], [], []
        for r in ordered:
            error = getattr(r, "error", None)
            if error:
                raise RuntimeError(
                    f"hf-cb: request {getattr(r, 'request_id', '?')} failed: {error}"
                )
            tokens = list(r.generated_tokens)[:max_tokens]
            if len(tokens) != max_tokens:
                raise RuntimeError(f"hf-cb decoded {len(tokens)} tokens, expected {max_tokens}")
            outputs.append(tokens)
            stamps = getattr(r, "timestamps", None) or []
            ttft.append(stamps[0] - start if stamps else None)
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None)
        self.timings = Timings(ttft, tpot)
        return outputs

    def warmup(self) -> None:
        """The tiny job; then its manager is dropped (see the class docstring)."""
        super().warmup()
        self._drop_manager()

    def close(self) -> None:
        self._drop_manager()  # the kept manager holds the KV pool
        super().close()

    def _drop_manager(self) -> None:
        model = getattr(self, "model", None)  # None once closed, unset if load failed
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if callable(destroy):
            destroy()

    def _cpu_cb_config(self, prompts: list[list[int]], max_tokens: int):
        """On the CPU only: a KV pool and batch sized to the job (see the class docstring)."""
        if (
            self.options.device.startswith("cuda")
            or "continuous_batching_config" not in self._signature
        ):
            return None
        from transformers import ContinuousBatchingConfig

        page = 16
        pages = sum(-(-(len(p) + max_tokens) // page) for p in prompts)
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        # the same field under two names: `block_size` (transformers 5.17), `page_size` (5.24)
        page_field = next((f for f in ("page_size", "block_size") if f in fields), None)
        if page_field is None or not {"num_blocks", "max_batch_tokens"} <= fields.keys():
            return None  # a config of another shape: its defaults
        return ContinuousBatchingConfig(
            **{page_field: page}, num_blocks=pages + 4, max_batch_tokens=512
        )


class _KeptManagerNotice(logging.Filter):
    """Drops the warning transformers logs on every generate_batch call that keeps its
    manager ("it was sized specifically for the requests passed"): hf-cb keeps it on purpose,
    for runs of one workload's shape."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "persistent_manager=True" not in record.getMessage()


_KEPT_MANAGER_NOTICE = _KeptManagerNotice()  # one object: addFilter skips a second add


def mxfp4_dequantized(folder: Path) -> dict[str, Any]:
    """from_pretrained's options for an MXFP4 checkpoint (gpt-oss as published): transformers'
    own dequantization to the model's dtype, which needs no kernels download (the GPU machine
    has no network); {} for every other folder."""
    config = folder / "config.json"
    if not config.is_file():
        return {}
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _in_input_order(results: Any, n: int) -> list[Any]:
    """generate_batch's results (a dict of request id -> output, or a list) in input order.
    Request ids are "req_<index>"; a dict whose ids do not parse keeps its own order."""
    items = list(results.values()) if isinstance(results, dict) else list(results)
    if len(items) != n:
        raise RuntimeError(f"hf-cb returned {len(items)} results for {n} prompts")
    try:
        return sorted(items, key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    except (AttributeError, ValueError):
        return items


class _StepClock:
    """Called by generate() once per decoding step (as a logits processor, just before the
    step's token is chosen): records when each of a batch's tokens was produced."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cuda:  # generate() syncs every step anyway; this makes the stamp exact
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores

    def ttft_tpot(self, start: float) -> tuple[float | None, float | None]:
        t = self.times
        if not t:
            return None, None
        return t[0] - start, ((t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None)


def _logits_processors(clock: _StepClock):
    from transformers import LogitsProcessor, LogitsProcessorList

    class _Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return clock(input_ids, scores)

    return LogitsProcessorList([_Clock()])
