"""The streaming engine: add requests, call step() until nothing is left.

One step = schedule (which tokens run) -> one forward over all of them -> sample the
sequences that reached their end -> append, check stops, release finished sequences.

Async scheduling (on by default on CUDA): the host's work for a step (scheduling, building
its tensors, then appending and stop-checking the tokens) takes about as long as the GPU's
forward of a large decode batch, and done in turn each waits for the other. So a step is
scheduled and queued *before* the previous step's tokens reach the host: its decodes read
those tokens on the device (Sequence.num_pending), and the previous step is finished while
the device runs this one. A request that stops on EOS or a stop string then costs one extra
row in the step after (its token is dropped); max_tokens and the context limit are known in
advance and cost nothing. Speculative decoding needs each step's tokens to propose the next
ones, so it keeps steps in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import sys
import time
from typing import TYPE_CHECKING

from kvbatch.engine.attention.backends import get_backend
from kvbatch.engine.core.choices import fork_choices, make_choices, needs_fork
from kvbatch.engine.core.config import (
    EngineConfig,
    SchedulerConfig,
    default_batched_tokens,
    default_long_prefill_step_ratio,
)
from kvbatch.engine.core.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from kvbatch.engine.core.prompt_input import (
    ContextLengthError,
    PromptType,
    check_embedding_input,
    prompt_token_ids,
)
from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import Sequence, SequenceStatus, TokenLogprobs
from kvbatch.engine.core.startup_heap import freeze_startup_heap, thaw_startup_heap
from kvbatch.engine.core.stopping import StopChecker
from kvbatch.engine.exec.launched_step import LaunchedStep, StepResult, start_clock
from kvbatch.engine.exec.runner import ModelRunner, kv_bytes_per_block
from kvbatch.engine.kv.context_len import CAPPED_AT_POOL, chosen_context_len
from kvbatch.engine.kv.hybrid import kv_manager_for
from kvbatch.engine.kv.layout import KVLayout, plan_layout
from kvbatch.engine.kv.sizing import (
    KVPoolRequest,
    fitted_max_model_len,
    kv_pool_blocks,
    log_kv_pool,
)
from kvbatch.engine.kv.stateful import plan_state_slots, state_shape, stateful_manager
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.pooling.config import PoolingConfig, read_pooling_config
from kvbatch.engine.pooling.outputs import EmbeddingOutput
from kvbatch.engine.quant.kv_cache import apply_kv_cache_scales
from kvbatch.engine.reasoning.registry import choose_reasoning_parser
from kvbatch.engine.sched.scheduler import Scheduler
from kvbatch.engine.sched.step_cost import StepCostModel
from kvbatch.engine.structured.after_reasoning import GrammarAfterReasoning

if TYPE_CHECKING:
    from kvbatch.engine.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)

# Decode steps of more sequences than this run eagerly; each bucket's graph costs capture time
# (36 buckets up to 512, each plain and shared-prefix). 512 as vLLM's default capture size:
# for a small model the GPU is not busy long enough to hide an eager step's hundreds of kernel
# launches (each Triton launcher costs tens of microseconds of Python) even at 512 sequences.
CUDA_GRAPH_MAX_BATCH = 512


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Load the model, size and build the KV pool, then the scheduler and runner; on CUDA
        capture the decode graphs, and freeze the startup heap last (engine/core/
        startup_heap.py), so that what it freezes is everything the engine starts with."""
        self.config = config
        # an earlier engine's freeze: a dropped engine's cycles go before this one allocates
        thaw_startup_heap()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.kv_dtype = config.cache.kv_torch_dtype(self.dtype)  # kv_cache_dtype
        loaded = load_model(config.model, self.dtype, self.device, config.quantization)
        self.model, self.model_config = loaded.model, loaded.config
        if self.model_config.is_latent and config.cache.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported for {self.model_config.architecture}: "
                "its latent (MLA) cache has no FP8 path yet; use kv_cache_dtype='auto'"
            )
        apply_kv_cache_scales(
            self.model, loaded.kv_cache_scales, loaded.quantization, self.kv_dtype
        )
        self.quantization, self.weight_bytes = loaded.quantization_method, loaded.weight_bytes
        log.info(
            "weights: %.1f MiB (%s)",
            self.weight_bytes / (1 << 20),
            f"quantized: {self.quantization}" if self.quantization else f"{self.dtype}",
        )
        self.tokenizer = loaded.tokenizer
        self.model_context = self.model_config.max_position_embeddings  # the model's own
        self.max_model_len = self._max_model_len()  # capped at the KV pool below if not asked
        scheduler_config = self._resolved_scheduler_config()
        self.async_scheduling = self._async_scheduling()
        backend = get_backend(config.attention_backend, self.device, self.kv_dtype)
        # A draft model keeps a KV pool of as many blocks as the target's: load it first, so
        # that its weights are counted in free memory and its blocks in the KV budget.
        draft = self._load_draft_model()
        self.kv_layout = self._kv_layout()
        num_blocks = self._checked_num_blocks(backend, scheduler_config, draft)
        full_attention_blocks = num_blocks
        state_plan = self._state_plan(num_blocks, scheduler_config)  # hybrid models only
        if state_plan is not None:
            num_blocks = state_plan.num_blocks
        scheduler_config = dataclasses.replace(scheduler_config, max_model_len=self.max_model_len)
        self.model.rotary.fit_context(self.max_model_len)  # LongRoPE: short or long factors
        cache = config.cache
        self.kv = kv_manager_for(
            self.kv_layout,
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            self.max_model_len,
            scheduler_config.max_num_seqs,
        )
        if state_plan is not None:  # a hybrid model's state slots beside the blocks
            self.kv = stateful_manager(
                self.kv,
                state_plan,
                self.model_config.linear,
                self.dtype,
                self.device,
                self.max_model_len,
                full_attention_blocks
                * self.model_config.num_kv_layers
                // self.model_config.num_layers,
            )
        self.step_cost = self._step_cost_model(scheduler_config)
        self.scheduler = Scheduler(scheduler_config, self.kv, self.step_cost)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            num_blocks,
            cache.block_size,
            self.device,
            self.dtype,
            backend,
            seed=config.seed,
            cascade=config.cascade_attention,
            kv_dtype=self.kv_dtype,
        )
        # a reasoning model's format: how answers split, where a grammar starts, what ends them
        self.reasoning = choose_reasoning_parser(config.reasoning_parser, self.tokenizer)
        eos = loaded.eos_token_ids + (self.reasoning.stop_token_ids if self.reasoning else ())
        self.stop_checker = StopChecker(
            tuple(dict.fromkeys(eos)), self.max_model_len, self.tokenizer
        )
        self.spec = None  # speculative decoding (engine/spec/), when config.speculative is set
        if config.speculative is not None:
            from kvbatch.engine.spec.decoder import build_spec_decoder

            self.spec = build_spec_decoder(config.speculative, self, draft)
        self.requests: dict[str, Sequence] = {}
        self.grammars: GrammarCompiler | None = None  # structured outputs, built on first use
        # Running sequences whose logits changes read every earlier token on the host
        # (grammars, penalties): while any runs, steps are not overlapped (async scheduling).
        self._num_host_token_seqs = 0
        self._ids = itertools.count()
        self._num_steps = self._computed = self._generated = self._prompt_tokens = 0
        self._num_finished = 0
        self._in_flight: LaunchedStep | None = None  # async scheduling: not yet finished
        self._capture_decode_graphs(backend, scheduler_config)
        # what one token of one sequence costs in the pool, every KV layer together
        self.kv_bytes_per_token = (
            kv_bytes_per_block(self.model, cache.block_size, self.kv_dtype) // cache.block_size
        )
        log_kv_pool(
            num_blocks,
            cache.block_size,
            self.kv_dtype,
            self.max_model_len,
            scheduler_config.max_num_seqs,
            self.max_model_len_why,
            layout=self.kv_layout,
            max_chunk=scheduler_config.max_num_batched_tokens,
            bytes_per_token=self.kv_bytes_per_token,
        )
        self.frozen_gc_objects = 0  # objects the startup freeze took out of GC passes
        if self._freeze_gc():
            self.frozen_gc_objects = freeze_startup_heap()
            log.info("froze %d objects out of the cycle collector's passes", self.frozen_gc_objects)

    def _state_plan(self, num_blocks: int, scheduler_config: SchedulerConfig):
        """A hybrid model's split of the KV budget between blocks and state slots
        (engine/kv/stateful.py); None for other models. Speculative decoding is refused for
        them: a rejected draft token cannot be taken back out of a recurrent state."""
        linear = self.model_config.linear
        if linear is None:
            return None
        if self.config.speculative is not None:
            raise ValueError(
                f"speculative decoding is not supported for {self.model_config.architecture}: "
                "its linear-attention layers keep recurrent states that cannot take back "
                "rejected draft tokens; run it without `speculative`"
            )
        block_bytes = kv_bytes_per_block(self.model, self.config.cache.block_size, self.kv_dtype)
        return plan_state_slots(
            state_shape(linear).bytes_per_slot(self.dtype),
            num_blocks,
            block_bytes,
            scheduler_config.max_num_seqs,
            blocks_fixed=self.config.cache.num_kv_blocks is not None,
        )

    def _resolved_scheduler_config(self) -> SchedulerConfig:
        """The scheduler's config with every default that depends on the device or the model
        filled in: tokens per step, the attention break-even context, the long-prefill step
        ratio, and max_model_len."""
        scheduler_config = self.config.scheduler
        if scheduler_config.max_num_batched_tokens is None:
            scheduler_config = dataclasses.replace(
                scheduler_config, max_num_batched_tokens=default_batched_tokens(self.device)
            )
        if scheduler_config.attention_break_even_context is None:
            scheduler_config = dataclasses.replace(
                scheduler_config,
                attention_break_even_context=self.model_config.attention_break_even_context,
            )
        if scheduler_config.long_prefill_step_ratio is None:
            scheduler_config = dataclasses.replace(
                scheduler_config,
                long_prefill_step_ratio=default_long_prefill_step_ratio(self.device),
            )
        return dataclasses.replace(scheduler_config, max_model_len=self.max_model_len)

    def _load_draft_model(self):
        """The draft model of `speculative="draft:..."`, or None."""
        spec = self.config.speculative
        if spec is not None and spec.method == "draft":
            return load_model(spec.draft_model, self.dtype, self.device)
        return None

    def _checked_num_blocks(self, backend, scheduler_config: SchedulerConfig, draft) -> int:
        """The KV pool's blocks (engine/kv/sizing.py). A max_model_len asked for is refused
        when one request of it would not fit; the model's own context is capped at the pool."""
        cache = self.config.cache
        num_blocks = kv_pool_blocks(
            KVPoolRequest(
                cache=cache,
                scheduler=scheduler_config,
                model=self.model,
                forward=self.model,  # the model is its step function
                backend=backend,
                device=self.device,
                kv_dtype=self.kv_dtype,
                model_dtype=self.dtype,
                max_model_len=self.max_model_len,
                draft_model=None if draft is None else draft.model,
                layout=self.kv_layout,
            )
        )
        chosen = self.max_model_len
        self.max_model_len = fitted_max_model_len(
            num_blocks,
            cache.block_size,
            chosen,
            asked=self.max_model_len_asked,
            draft=draft is not None,
            layout=self.kv_layout,
            max_chunk=scheduler_config.max_num_batched_tokens,
            wanted=self.max_model_len_why,
        )
        if self.max_model_len < chosen:
            self.max_model_len_why = CAPPED_AT_POOL
        return num_blocks

    def _kv_layout(self) -> KVLayout:
        """Which layers share a block table (engine/kv/layout.py)."""
        cfg = self.model_config
        windows = [cfg.layer_attention(i).sliding_window for i in range(cfg.num_layers)]
        owns_kv = [cfg.kv_owner(i) == i for i in range(cfg.num_layers)]
        return plan_layout(
            windows, self.config.cache.sliding_window_kv, self.max_model_len, owns_kv
        )

    def _step_cost_model(self, scheduler_config: SchedulerConfig) -> StepCostModel | None:
        """What times steps to size long prompts' chunks (engine/sched/step_cost.py), when a
        step ratio and a token threshold are both set; it sizes chunks against the runner's
        graph buckets, asked afresh each time (the runner is built after it)."""
        if not (
            scheduler_config.long_prefill_step_ratio
            and scheduler_config.long_prefill_token_threshold
        ):
            return None
        return StepCostModel(
            scheduler_config.long_prefill_step_ratio,
            scheduler_config.attention_break_even_context,
            chunk_buckets=lambda: self.runner.graph_chunk_buckets(),
        )

    def _capture_decode_graphs(self, backend, scheduler_config: SchedulerConfig) -> None:
        """On CUDA with the triton backend, decode steps replay graphs from now on."""
        if self.runner.states is not None:  # hybrid models' steps run eagerly
            return
        if self.model_config.is_latent:  # MLA prefill lays out its expanded K/V per step
            return
        if self.config.cuda_graphs and self.device.type == "cuda" and backend.name == "triton":
            self.runner.capture_step_graphs(
                min(scheduler_config.max_num_seqs, CUDA_GRAPH_MAX_BATCH),
                self.max_model_len,
                max_chunk=self.config.cuda_graph_max_chunk,
            )

    def _freeze_gc(self) -> bool:
        asked = self.config.freeze_gc
        return self.device.type == "cuda" if asked is None else asked

    def _async_scheduling(self) -> bool:
        asked = self.config.async_scheduling
        if self.config.speculative is not None:
            if asked:
                raise ValueError(
                    "async_scheduling needs each step's tokens only after the next step is "
                    "queued, and speculative decoding proposes from them: turn one off"
                )
            return False
        return self.device.type == "cuda" if asked is None else asked

    def _max_model_len(self) -> int:
        """The context asked for, else the caller's longest request or the model's (sets
        max_model_len_why, which the startup line says)."""
        scheduler = self.config.scheduler
        choice = chosen_context_len(
            scheduler.max_model_len, scheduler.longest_request, self.model_context
        )
        self.max_model_len_why = choice.why
        return choice.length

    @property
    def max_model_len_asked(self) -> bool:
        """Whether max_model_len was set; if not, the engine picked it (kv/sizing.py)."""
        return self.config.scheduler.max_model_len > 0

    def context_advice(self) -> str:
        """What admits a request longer than the context the engine capped at its KV cache,
        for the error that refuses one ("" when the model's whole context is in use, or
        max_model_len was set)."""
        if self.max_model_len_asked or self.max_model_len >= self.model_context:
            return ""
        return (
            f"; the KV cache holds {self.max_model_len} tokens of the model's "
            f"{self.model_context}: set max_model_len up to {self.model_context} with a "
            "kv_cache_bytes that holds it"
        )

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request. Raises ValueError (naming the problem) for a bad prompt."""
        params = params or SamplingParams()
        if not self.model_config.has_lm_head:
            raise ValueError(
                f"this checkpoint ({self.model_config.architecture} without its head) has no "
                "language-model head: it can embed (LLM.embed) but not generate"
            )
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self._check_context(len(token_ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer and this model has none; use stop_token_ids"
            )
        self._check_logits_options(params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, prompt=text)
        if self.runner.states is not None:  # its branch points get state snapshots
            for _ in range(params.n):
                self.runner.states.note_prompt(token_ids)
        self._prepare_sequence(seq)
        if params.n > 1:
            make_choices(seq, self._prepare_sequence)
        self.requests[request_id] = seq
        self._prompt_tokens += len(token_ids)
        self.scheduler.add(seq)
        return request_id

    def _check_context(self, prompt_len: int, max_tokens: int) -> None:
        """A prompt must leave room for one output token. Where the engine capped its context
        at the KV cache (max_model_len not set), max_tokens must fit too: a request would
        otherwise be cut short of the model's real context without a word."""
        if prompt_len >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens but the model's context is "
                f"max_model_len={self.max_model_len} (including at least one output token): "
                f"shorten the prompt{self.context_advice()}"
            )
        capped = not self.max_model_len_asked and self.max_model_len < self.model_context
        if capped and prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens and max_tokens asks for {max_tokens} more, "
                f"but max_model_len={self.max_model_len}: lower max_tokens to "
                f"{self.max_model_len - prompt_len} or less{self.context_advice()}"
            )

    def _check_logits_options(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logit_bias ids against the vocabulary, and
        that a schema compiles (once per distinct schema, kvbatch.engine.structured)."""
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias names token id {max(params.logit_bias)} but the vocabulary has "
                f"{vocab} tokens: use ids in [0, {vocab})"
            )
        if params.structured_outputs is not None:
            self._grammar_compiler().compile(params.structured_outputs)

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first constrained request: it indexes the whole vocabulary."""
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer and this model has none")
            # Imported on the first constrained request, not with the engine: xgrammar is a
            # dependency of structured outputs only, and images built for generation alone
            # (the GPU check's) run without it.
            from kvbatch.engine.structured.grammar import GrammarCompiler

            self.grammars = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, sorted(self.stop_checker.eos)
            )
        return self.grammars

    def _prepare_sequence(self, seq: Sequence) -> None:
        """A new sequence's grammar matcher; logits-changing requests never speculate (the
        rejection sampler verifies drafts against unchanged target probabilities)."""
        params = seq.params
        if params.structured_outputs is not None:
            seq.grammar = self._grammar_compiler().matcher(params.structured_outputs)
            if self.reasoning is not None:  # the grammar constrains the answer, not the thinking
                end = self.reasoning.reasoning_end(seq.prompt_token_ids)
                seq.grammar = GrammarAfterReasoning(seq.grammar, end)
        if params.processes_logits:
            seq.spec_resume_step = sys.maxsize
        if params.needs_host_tokens:
            self._num_host_token_seqs += 1

    @functools.cached_property
    def pooling_config(self) -> PoolingConfig:
        """How this model pools embeddings: its sentence-transformers files, or last-token
        normalised (engine/pooling/config.py). Read on first use: generation never needs it."""
        return read_pooling_config(self.config.model)

    def add_embedding_request(
        self,
        prompt: PromptType,
        request_id: str | None = None,
        pooling: PoolingConfig | None = None,
    ) -> str:
        """Queue a prefill-only request: its prompt is computed (in chunks, from prefix-cache
        hits where the pooling allows), never sampled, and step() returns an EmbeddingOutput
        with the pooled vector; its blocks are freed at once, full ones kept in the prefix
        cache. `pooling` overrides the model's (a reranker's prompt: its last state as it is).
        Raises ValueError (naming the problem) for a bad prompt."""
        pooling = pooling or self.pooling_config
        text, token_ids = self._tokenize(prompt)
        check_embedding_input(token_ids, self.max_model_len)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams(max_tokens=1)  # never sampled; keeps token_limit at the prompt
        seq = Sequence(request_id, token_ids, params, prompt=text, pooling=pooling)
        self.runner.pooler.add_request(request_id)
        self.requests[request_id] = seq
        self._prompt_tokens += len(token_ids)
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            group = seq.choices
            for s in group.seqs if group is not None else [seq]:
                if s.is_finished:
                    continue
                if s.params.needs_host_tokens:
                    self._num_host_token_seqs -= 1
                if s.choice_index and not group.forked:  # never reached the scheduler
                    s.status = SequenceStatus.FINISHED
                else:
                    self.scheduler.abort(s)
                if self.spec is not None:
                    self.spec.release(s)
            self.runner.pooler.release(request_id)

    def capture_chunk_graphs(self) -> int:
        """Capture now, rather than in a later step that would wait for it, every CUDA graph of
        a step with a prompt chunk that the decode batch sizes met so far may still need (CUDA,
        triton, mixed-step graphs on; else 0): engine/exec/cuda_graphs.py
        `StepGraphs.capture_chunk_buckets`. Returns how many; only between jobs."""
        if self.has_unfinished():
            raise RuntimeError("capture_chunk_graphs: requests are still running; call it idle")
        graphs = self.runner.step_graphs
        return graphs.capture_chunk_buckets() if graphs is not None else 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingOutput]:
        """Run one step; returns the requests that finished in it (with async scheduling, the
        requests whose last token came from the step before: the final call runs no model),
        an EmbeddingOutput for each embedding request."""
        if self._in_flight is not None and self._num_host_token_seqs:
            # A grammar's mask or a penalty needs the previous token on the host: finish the
            # step in flight before scheduling the next.
            previous, self._in_flight = self._in_flight, None
            return self._finish(self._collect(previous))
        # timed from here: what the host does before the forward is part of the step's time
        started = start_clock(self.device) if self.step_cost is not None else None
        if self.spec is not None:  # drafts first: the scheduler counts them in the budget
            self.spec.propose(self.scheduler.running, self._num_steps)
        out = self.scheduler.schedule()
        launched = self._launch(out, started) if out.chunks else None
        if not self.async_scheduling:
            return self._finish(self._collect(launched)) if launched else self._nothing_ran()
        previous, self._in_flight = self._in_flight, launched
        if launched is not None:
            for row, seq in enumerate(launched.seqs):  # their next decode reads it on device
                seq.num_pending += 1
                seq.pending_row = row
        if previous is None:
            return [] if launched else self._nothing_ran()
        return self._finish(self._collect(previous))

    def _nothing_ran(self) -> list[RequestOutput]:
        if self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not place any request: KV cache too small")
        return []

    def _launch(self, out, started=None) -> LaunchedStep:
        launched = self.runner.launch(out, started)
        launched.shape = out.shape
        if out.shape is not None and launched.padded_chunk:  # the rows its graph computed
            launched.shape = dataclasses.replace(out.shape, prefill_rows=launched.padded_chunk)
        self.scheduler.advance(out)
        self._num_steps += 1
        self._computed += out.num_tokens
        return launched

    def _collect(self, launched: LaunchedStep) -> StepResult:
        """The step's tokens on the host: the host waits here for the device."""
        result = launched.result()
        if self.step_cost is not None and launched.shape is not None:
            seconds = launched.seconds
            if seconds is not None:
                self.step_cost.observe(launched.shape, seconds)
        return result

    def _finish(self, result: StepResult) -> list[RequestOutput | EmbeddingOutput]:
        """Append a step's tokens, check stops, release the finished requests."""
        if result.logprobs is not None:
            chosen, top_ids, top_lps = result.logprobs
        finished = []
        now = time.perf_counter()
        first_row = 0  # sampler rows follow the new tokens, flattened
        for seq, tokens in zip(result.seqs, result.token_ids):
            if seq.num_pending:
                seq.num_pending -= 1
            if seq.status is SequenceStatus.FINISHED:  # stopped a step earlier, or aborted
                first_row += len(tokens)
                continue
            # With speculation several tokens arrive at once: each is checked for stops in
            # turn, exactly as if decoded alone, and those after a stop are dropped.
            kept = 0
            for row, token in enumerate(tokens, first_row):
                seq.token_ids.append(token)
                seq.record_token_time(now)
                if seq.logprobs is not None and result.logprobs is not None:
                    n = seq.params.logprobs
                    seq.logprobs.append(
                        TokenLogprobs(
                            token, chosen[row], list(zip(top_ids[row][:n], top_lps[row][:n]))
                        )
                    )
                kept += 1
                if seq.grammar is not None and self._grammar_done(seq, token):
                    finished.append(seq)
                    break
                if self.stop_checker.check(seq, token):
                    finished.append(seq)
                    break
            if needs_fork(seq) and seq.num_output_tokens:
                fork_choices(seq, self.kv, self.scheduler)
            first_row += len(tokens)
            self._generated += kept
            if seq.draft_token_ids:
                num_drafts, num_accepted = len(seq.draft_token_ids), len(tokens) - 1
                self.scheduler.accept_drafts(seq, num_accepted)
                # Drafts cut off by a stop are not in the output: reported as rejected.
                used = min(num_accepted, kept)
                self.spec.observe(seq, num_drafts, num_accepted, used, self._num_steps)
        for seq, vector in zip(result.pooled_seqs, result.pooled if result.pooled_seqs else []):
            if seq.status is not SequenceStatus.FINISHED:  # else aborted while in flight
                seq.embedding = vector
                finished.append(seq)
        if self.spec is not None:
            for seq in finished:
                self.spec.release(seq)
        self.scheduler.finish(finished)
        self._num_host_token_seqs -= sum(1 for s in finished if s.params.needs_host_tokens)
        done = [s for s in finished if s.choices is None or s.choices.finish_one()]
        self._num_finished += len(done)
        return [self._output(self.requests.pop(s.request_id)) for s in done]

    @staticmethod
    def _grammar_done(seq: Sequence, token: int) -> bool:
        """Advance seq's grammar past `token`; True (finish_reason "stop") once the grammar
        has ended. A token the grammar refuses cannot come from the masked sampler: it ends
        the sequence as an error rather than emit text that breaks the schema."""
        if not seq.grammar.accept(token):
            seq.finish_reason, seq.stop_reason = "error", token
            return True
        if seq.grammar.is_terminated():
            seq.finish_reason, seq.stop_reason = "stop", None
            return True
        return False

    def _completion(self, seq: Sequence) -> CompletionOutput:
        ids = seq.output_token_ids
        text = seq.output_text
        if text is None:
            text = self.stop_checker.decode(ids)
        return CompletionOutput(
            seq.choice_index, text, ids, seq.finish_reason, seq.stop_reason, seq.logprobs
        )

    def _output(self, seq: Sequence) -> RequestOutput | EmbeddingOutput:
        if seq.pooling is not None:
            return EmbeddingOutput(
                seq.request_id,
                seq.prompt,
                seq.prompt_token_ids,
                seq.embedding,
                num_cached_tokens=max(seq.num_cached_tokens, 0),
            )
        choices = seq.choices.seqs if seq.choices is not None else [seq]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[self._completion(s) for s in choices],
            finished=seq.status is SequenceStatus.FINISHED,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            spec_stats=seq.spec_stats if self.spec is not None else None,
            metrics=_metrics(seq),
        )

    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        return EngineStats(
            num_requests=len(self.requests) + self._num_finished,
            num_finished=self._num_finished,
            num_running=len(self.scheduler.running),
            num_steps=self._num_steps,
            prompt_tokens=self._prompt_tokens,
            computed_tokens=self._computed,
            generation_tokens=self._generated,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            kv_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            block_size=self.config.cache.block_size,
            weight_bytes=self.weight_bytes,
            quantization=self.quantization,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        s = self.spec.stats
        return dict(
            spec_draft_tokens=s.num_draft_tokens,
            spec_accepted_tokens=s.num_accepted_tokens,
            spec_acceptance_by_position=s.acceptance_by_position,
        )


def _metrics(seq: Sequence) -> RequestMetrics:
    first, last, n = seq.first_token_time, seq.last_token_time, seq.num_output_tokens
    return RequestMetrics(
        arrival_time=seq.arrival_time,
        time_to_first_token=None if first is None else first - seq.arrival_time,
        time_per_output_token=(last - first) / (n - 1) if first is not None and n > 1 else None,
        max_token_gap=seq.max_token_gap,
        finished_time=last,
        queue_time=None
        if seq.first_scheduled_time is None
        else seq.first_scheduled_time - seq.arrival_time,
    )
