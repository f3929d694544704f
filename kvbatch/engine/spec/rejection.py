"""The rejection sampler: accepts a prefix of the drafts so that outputs follow the target.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). A sequence
proposes drafts d_1..d_k, each drawn from the proposer's distribution q_j; one target forward
gives the target's distributions p_1..p_{k+1} (p_j: after temperature, top-k, top-p, min-p,
exactly what the sampler would draw from at that position). In order:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    at the first rejection: draw from normalize(max(p_j - q_j, 0)) and stop
    all k accepted: draw a bonus token from p_{k+1}

Each emitted token is then distributed exactly as if the target had sampled it alone. For
n-gram drafts (and greedy drafts) q_j is one-hot, so the residual is p_j with d_j removed. A
greedy request has a one-hot p_j at the argmax: drafts are accepted while they equal the
target's argmax, then the argmax follows, so tokens are identical to decoding without drafts.

Uniforms are float64; draws from a distribution use the sampler's exponential race, with
noise from (seed, offset) for seeded requests, so they are reproducible in any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbatch.engine.exec.penalties import token_histories
from kvbatch.engine.exec.sampler import (
    Sampler,
    SamplerOutput,
    SamplingTensors,
    mix32,
    process_logits,
    seeded_exponential,
)
from kvbatch.engine.structured.batch_mask import fill_token_bitmask

_M32 = 0xFFFFFFFF


@dataclass
class RejectionOutput:
    num_accepted: Tensor  # [B] int64: drafts accepted, a prefix of each row's drafts
    token_ids: Tensor  # [B] int64: the token after the accepted drafts (resampled or bonus)


def rejection_sample(
    target_probs: Tensor,  # [B, K + 1, V]: p at each draft position, then the bonus position
    draft_ids: Tensor,  # [B, K] int64; entries at or past num_drafts are ignored
    num_drafts: Tensor,  # [B] int64, <= K
    draft_probs: Tensor | None,  # [B, K, V] q, or None when every q is one-hot at its draft
    uniforms: Tensor,  # [B, K] float64 in [0, 1)
    noise: Callable[[Tensor], Tensor],  # positions [B] -> Exp(1) noise [B, V] for those rows
    greedy: Tensor | None = None,  # [B] bool: p is one-hot at the argmax for these rows
) -> RejectionOutput:
    """Vectorised over the batch; see the module docstring."""
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    rows = torch.arange(batch, device=target_probs.device)
    valid = torch.arange(k, device=num_drafts.device)[None, :] < num_drafts[:, None]  # [B, K]
    safe_ids = torch.where(valid, draft_ids, 0)
    p_draft = target_probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1).double()
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1).double()
    # u < p / q accepts with probability min(1, p / q); q(d) > 0 because d was drawn from q.
    accept = uniforms < p_draft / q_draft.clamp_min(torch.finfo(torch.float64).tiny)
    argmax = None
    if greedy is not None and bool(greedy.any()):
        argmax = target_probs.argmax(dim=-1)  # [B, K + 1]; ties -> lowest id, like the sampler
        accept = torch.where(greedy[:, None], argmax[:, :k] == draft_ids, accept)
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # length of the accepted prefix

    final = target_probs[rows, num_accepted]  # [B, V]: p after the accepted run
    rejected = num_accepted < num_drafts
    if bool(rejected.any()):
        at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q = torch.zeros_like(final).scatter_(-1, safe_ids[rows, at][:, None], 1.0)
        else:
            q = draft_probs[rows, at]
        residual = (final - q).clamp_min(0.0)
        # A rejection implies p(d) < q(d), hence mass elsewhere; rounding aside, keep p then.
        use = rejected & (residual.sum(dim=-1) > 0)
        final = torch.where(use[:, None], residual, final)
    token_ids = (final / noise(num_accepted)).argmax(dim=-1)
    if argmax is not None:
        token_ids = torch.where(greedy, argmax[rows, num_accepted], token_ids)
    return RejectionOutput(num_accepted, token_ids)


def seeded_uniform(seeds: Tensor, offsets: Tensor) -> Tensor:
    """U(0, 1) float64, a pure function of (seed, offset), independent of the sampler's
    token noise for the same pair (other mixing constants)."""
    seeds = seeds.to(torch.int64)
    key = mix32((seeds & _M32) ^ 0x2545F491)
    key = mix32(key ^ ((seeds >> 32) & _M32))
    key = mix32(key ^ (offsets.to(torch.int64) & _M32))
    x = mix32(key ^ 0x68E31DA4)
    return (x.to(torch.float64) + 0.5) / 2.0**32


def verify(
    sampler: Sampler, logits: Tensor, seqs: Sequence, vocab_size: int
) -> tuple[list[list[int]], SamplerOutput]:
    """Accept drafts for every sampled sequence of a step.

    `logits` [R, V] hold 1 + k rows per sequence, in order (k = len(seq.draft_token_ids),
    possibly 0): the rows of its last token and of each draft. Returns each sequence's new
    tokens (accepted drafts, then one sampled token) and a SamplerOutput whose rows follow
    those tokens flattened (logprobs of the raw logits, as the sampler reports them).
    """
    device = logits.device
    ks = [len(s.draft_token_ids) for s in seqs]
    params, offsets = [], []
    for s, k in zip(seqs, ks):
        params.extend([s.params] * (k + 1))
        offsets.extend(range(s.num_output_tokens, s.num_output_tokens + k + 1))
    # Rows that change their logits (grammars, penalties, bias) never carry drafts
    # (LLMEngine turns their speculation off): their one row is processed as the sampler does.
    rows_seqs = [s for s, k in zip(seqs, ks) for _ in range(k + 1)]
    t = SamplingTensors.from_params(
        params,
        offsets,
        vocab_size,
        device,
        histories=token_histories(rows_seqs),
        token_bitmask=fill_token_bitmask([s.grammar for s in rows_seqs], vocab_size, device),
    )
    raw_logits = logits
    if t.processes_logits:
        logits = process_logits(logits.float().clone(), t)
    batch, max_k = len(seqs), max(ks)
    num_drafts = torch.tensor(ks, dtype=torch.long, device=device)
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)  # [B]: each seq's first row
    position = torch.arange(max_k + 1, device=device)
    index = starts[:, None] + torch.minimum(position[None, :], num_drafts[:, None])  # [B, K+1]
    draft_ids = torch.tensor(
        [s.draft_token_ids + [0] * (max_k - k) for s, k in zip(seqs, ks)],
        dtype=torch.long,
        device=device,
    ).view(batch, max_k)

    if t.all_greedy:  # fast path: no [*, V] probabilities at all
        argmax = logits.argmax(dim=-1)[index]  # [B, K + 1]
        valid = position[None, :max_k] < num_drafts[:, None]
        match = (argmax[:, :max_k] == draft_ids) & valid
        num_accepted = match.long().cumprod(dim=1).sum(dim=1)
        final = argmax[torch.arange(batch, device=device), num_accepted]
    else:
        probs = sampler.processed_probs(logits, t)  # [R, V]
        greedy = t.temperature[starts] == 0
        uniforms = torch.rand(
            batch, max_k, dtype=torch.float64, device=device, generator=sampler.generator(device)
        )
        seeded = t.seeds[starts] >= 0
        if bool(seeded.any()):
            rows = index[:, :max_k]
            uniforms = torch.where(
                seeded[:, None], seeded_uniform(t.seeds[rows], t.offsets[rows]), uniforms
            )

        def noise(at: Tensor) -> Tensor:
            rows = starts + at
            e = torch.empty(batch, vocab_size, device=device).exponential_(
                generator=sampler.generator(device)
            )
            e.clamp_(min=torch.finfo(torch.float32).tiny)
            if bool(seeded.any()):
                s = seeded.nonzero().squeeze(-1)
                e[s] = seeded_exponential(t.seeds[rows[s]], t.offsets[rows[s]], vocab_size)
            return e

        draft_probs = None
        if any(s.draft_probs is not None for s in seqs):
            draft_probs = torch.zeros(batch, max_k, vocab_size, device=device)
            for b, (s, k) in enumerate(zip(seqs, ks)):
                if s.draft_probs is not None:
                    draft_probs[b, :k] = s.draft_probs[:k]
                elif k:
                    draft_probs[b, torch.arange(k), draft_ids[b, :k]] = 1.0
        out = rejection_sample(
            probs[index], draft_ids, num_drafts, draft_probs, uniforms, noise, greedy
        )
        num_accepted, final = out.num_accepted, out.token_ids

    accepted = num_accepted.tolist()
    finals = final.tolist()
    tokens = [s.draft_token_ids[:a] + [f] for s, a, f in zip(seqs, accepted, finals)]
    flat = torch.tensor([x for ts in tokens for x in ts], dtype=torch.long, device=device)
    if t.max_num_logprobs < 0:
        return tokens, SamplerOutput(flat, None, None, None)
    emitted = torch.cat(
        [torch.arange(st, st + a + 1) for st, a in zip(starts.tolist(), accepted)]
    ).to(device)
    raw = torch.log_softmax(raw_logits[emitted].float(), dim=-1)
    chosen = raw.gather(-1, flat[:, None]).squeeze(-1)
    top_logprobs, top_ids = raw.topk(t.max_num_logprobs, dim=-1)
    return tokens, SamplerOutput(flat, chosen, top_ids, top_logprobs)
