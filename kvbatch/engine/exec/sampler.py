"""Batch-wide token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
after the logits changes some rows ask for (a grammar's token bitmask, logit bias, penalties).

Everything is vectorised over the batch; Python only looks at the batch-wide flags in
`SamplingTensors` to skip stages that no row needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.exec.penalties import LogitBias, PenaltyTensors, TokenHistory
from kvbatch.engine.structured.bitmask import TokenBitmask, apply_token_bitmask

_M32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """The sampling options of one batch, one row per request, on the logits' device.

    The flags only look at sampled (non-greedy) rows: a greedy row never needs top-k etc.
    """

    temperature: Tensor  # [B] float32; greedy rows hold 0 (never divided by)
    top_k: Tensor  # [B] int64; vocab_size where disabled
    top_p: Tensor  # [B] float32
    min_p: Tensor  # [B] float32
    seeds: Tensor  # [B] int64; -1 = unseeded
    offsets: Tensor  # [B] int64; index of the token being sampled among the request's outputs
    seeded_rows: Tensor  # [S] int64; sampled rows that carry a seed
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    any_seeded: bool
    any_unseeded: bool  # some sampled row has no seed: the sampler's generator is needed
    max_num_logprobs: int  # -1 when no row asked for logprobs
    # Logits changes, applied in this order before anything else; None where no row asks.
    token_bitmask: TokenBitmask | None = None  # the grammars' allowed tokens
    logit_bias: LogitBias | None = None
    penalties: PenaltyTensors | None = None

    @property
    def processes_logits(self) -> bool:
        return (
            self.token_bitmask is not None
            or self.logit_bias is not None
            or self.penalties is not None
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_lens: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        histories: Sequence[TokenHistory] | None = None,
        token_bitmask: TokenBitmask | None = None,
    ) -> SamplingTensors:
        """Build the batch's tensors; `output_lens[i]` = tokens request i has generated so far.

        `histories[i]`: row i's prompt and output tokens, needed when some row has a penalty.
        `token_bitmask`: the rows' allowed tokens (kvbatch.engine.structured), when some row
        is constrained by a grammar.
        """
        if len(params) != len(output_lens):
            raise ValueError(
                f"params and output_lens must have the same length, "
                f"got {len(params)} and {len(output_lens)}"
            )
        device = torch.device(device)
        penalties = None
        if any(p.uses_penalties for p in params):
            if histories is None or len(histories) != len(params):
                raise ValueError("rows with penalties need histories, one per row")
            penalties = PenaltyTensors.build(params, histories, vocab_size, device)
        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        seeds = [-1 if p.seed is None else p.seed for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        seeded_rows = [i for i in sampled if seeds[i] >= 0]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        # Three host-to-device copies instead of seven, none blocking: a blocking copy would
        # wait for the step's forward (queued just before) and any step queued before it.
        pin = torch.device(device).type == "cuda"
        floats = torch.tensor(
            [temperature, [p.top_p for p in params], [p.min_p for p in params]],
            dtype=torch.float32,
            pin_memory=pin,
        ).to(device, non_blocking=True)
        ints = torch.tensor(
            [top_k, seeds, list(output_lens)], dtype=torch.int64, pin_memory=pin
        ).to(device, non_blocking=True)
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seeds=ints[1],
            offsets=ints[2],
            seeded_rows=torch.tensor(seeded_rows, dtype=torch.int64, pin_memory=pin).to(
                device, non_blocking=True
            ),
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            need_top_k=any(top_k[i] < vocab_size for i in sampled),
            need_top_p=any(params[i].top_p < 1.0 for i in sampled),
            need_min_p=any(params[i].min_p > 0.0 for i in sampled),
            any_seeded=bool(seeded_rows),
            any_unseeded=len(seeded_rows) < len(sampled),
            max_num_logprobs=max(logprobs, default=-1),
            token_bitmask=token_bitmask,
            logit_bias=LogitBias.build(params, device),
            penalties=penalties,
        )


@dataclass
class SamplerOutput:
    """One sampled token per row, and the logprobs the rows asked for."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] float32; chosen token under log_softmax(raw logits)
    top_ids: Tensor | None  # [B, n] int64, n = max_num_logprobs; rows asking fewer use a prefix
    top_logprobs: Tensor | None  # [B, n] float32, descending


class Sampler:
    """Picks the next token of every row of a batch in one vectorised pass.

    Sampled rows use the exponential race: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i is
    token i with probability p_i / sum(p) (E_i / p_i ~ Exp(p_i); the smallest of independent
    exponentials is the i-th with probability proportional to its rate). It needs no
    normalisation and no cumulative sum, and the noise can come from anywhere: the sampler's
    generator for unseeded rows, a counter-based hash for seeded rows.
    """

    def __init__(self, seed: int | None = None) -> None:
        """`seed` seeds the generator used for unseeded rows (None = nondeterministic)."""
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, t: SamplingTensors) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]; everything stays on `logits.device`."""
        logits = raw_logits = logits.float()
        if t.processes_logits:  # on a copy: logprobs are the raw model's, as in vLLM
            logits = process_logits(logits.clone(), t)
        if t.all_greedy:
            token_ids = logits.argmax(dim=-1)  # ties -> lowest index, like transformers
        else:
            token_ids = self._sample(logits, t)
            if t.any_greedy:
                token_ids = torch.where(t.temperature == 0, logits.argmax(dim=-1), token_ids)

        if t.max_num_logprobs < 0:
            return SamplerOutput(token_ids, None, None, None)
        raw_logprobs = torch.log_softmax(raw_logits, dim=-1)  # [B, V]
        chosen = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        top_logprobs, top_ids = raw_logprobs.topk(t.max_num_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)

    @staticmethod
    def argmax(logits: Tensor) -> SamplerOutput:
        """Every row greedy and no logprobs: what __call__ gives for such a batch, without
        building its SamplingTensors (ties -> lowest index, in any float dtype)."""
        return SamplerOutput(logits.argmax(dim=-1), None, None, None)

    def _sample(self, logits: Tensor, t: SamplingTensors) -> Tensor:
        probs = self.processed_probs(logits, t, normalize=False)
        return (probs / self.noise(probs, t)).argmax(dim=-1)

    @staticmethod
    def processed_probs(logits: Tensor, t: SamplingTensors, normalize: bool = True) -> Tensor:
        """The distribution each sampled row draws from [B, V]: temperature, top-k, top-p,
        min-p applied (what speculative decoding's rejection sampler calls p). Greedy rows get
        softmax(logits): callers replace them by the argmax. normalize=False skips the final
        renormalisation after min-p (the exponential race does not need it)."""
        # Greedy rows divide by 1: their result is replaced by the argmax afterwards.
        temperature = torch.where(t.temperature > 0, t.temperature, 1.0)
        logits = logits.float() / temperature[:, None]
        if t.need_top_k or t.need_top_p:
            logits = _apply_top_k_top_p(logits, t)
        probs = logits.softmax(dim=-1)  # [B, V]
        if t.need_min_p:
            threshold = t.min_p * probs.amax(dim=-1)
            probs = probs.masked_fill(probs < threshold[:, None], 0.0)
            if normalize:
                probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def noise(self, probs: Tensor, t: SamplingTensors) -> Tensor:
        """Exp(1) noise [B, V] for the exponential race: seeded rows from (seed, offset),
        the others from the sampler's generator (greedy rows: ones, they are replaced)."""
        if t.any_unseeded:
            noise = torch.empty_like(probs).exponential_(generator=self.generator(probs.device))
            # Exp(1) noise of exactly 0 would turn an excluded token's 0 / 0 into NaN.
            noise.clamp_(min=torch.finfo(torch.float32).tiny)
        else:
            noise = torch.ones_like(probs)  # only greedy rows read it, and they are replaced
        if t.any_seeded:
            rows = t.seeded_rows
            noise[rows] = seeded_exponential(t.seeds[rows], t.offsets[rows], probs.shape[-1])
        return noise

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device` (shared with speculative decoding)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen


def process_logits(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Apply the grammars' bitmask, logit bias and penalties to `logits` [B, V] float32, in
    place (vLLM's order: bitmask, bias, penalties); returns `logits`."""
    if t.token_bitmask is not None:
        apply_token_bitmask(logits, t.token_bitmask)
    if t.logit_bias is not None:
        t.logit_bias.apply(logits)
    if t.penalties is not None:
        t.penalties.apply(logits)
    return logits


def _apply_top_k_top_p(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Mask to -inf the tokens outside each row's top-k, then outside its top-p nucleus.

    One descending sort serves both: top-k keeps the first k sorted positions; top-p keeps
    a token while the probability mass strictly before it (renormalised over the top-k) is
    < top_p, i.e. the smallest prefix whose mass reaches top_p. The first token always stays.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    vocab_size = logits.shape[-1]
    positions = torch.arange(vocab_size, device=logits.device)
    mask = positions[None, :] >= t.top_k[:, None]  # [B, V], in sorted order
    if t.need_top_p:
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows with top_p == 1 are exempt: a rounded cumsum can exceed 1 before the tail.
        mask |= (mass_before >= t.top_p[:, None]) & (t.top_p < 1.0)[:, None]
    mask = torch.empty_like(mask).scatter_(-1, sorted_ids, mask)  # back to vocabulary order
    return logits.masked_fill(mask, float("-inf"))


def mix32(x: Tensor) -> Tensor:
    """lowbias32 (Chris Wellons' hash prospector): a 32-bit bijection with strong avalanche.

    `x` is int64 holding values in [0, 2**32). Each multiplier is below 2**31 in magnitude
    (0x846CA68B is used as its negative twin 0x846CA68B - 2**32, equal modulo 2**32), so every
    product stays inside int64 and masking keeps the exact low 32 bits.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * (0x846CA68B - 2**32)) & _M32
    return x ^ (x >> 16)


def seeded_exponential(seeds: Tensor, offsets: Tensor, vocab_size: int) -> Tensor:
    """Exp(1) noise [S, V] float32 that is a pure function of (seed, offset, token index).

    This is what makes a seeded request reproducible whatever batch it lands in, after
    preemption and on any machine: only integer ops, no generator state. Each row absorbs the
    seed's two 32-bit halves and the offset into a 32-bit key through lowbias32 rounds (so
    neighbouring seeds or offsets give unrelated keys); each token then goes through two
    rounds keyed by two derived keys, so rows' streams are not shifted copies of each other.
    u = (x + 0.5) / 2**32 lies strictly inside (0, 1) in float64, so E = -log(u) is finite > 0.
    """
    seeds = seeds.to(torch.int64)
    key = mix32((seeds & _M32) ^ 0x9E3779B9)
    key = mix32(key ^ ((seeds >> 32) & _M32))
    key = mix32(key ^ (offsets.to(torch.int64) & _M32))
    key2 = mix32(key ^ 0x85EBCA6B)
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    x = mix32(token[None, :] ^ key[:, None])  # [S, V]
    x = mix32(x ^ key2[:, None])
    u = (x.to(torch.float64) + 0.5) / 2.0**32
    return (-torch.log(u)).to(torch.float32)
