"""transformers as the reference the engine is checked against: greedy tokens and logits.

Everything runs on the CPU in float32 with transformers' SDPA attention (on the tiny
checkpoints it is as close to a float64 run as "eager" is: both within ~3e-6 on the logits).
Each prompt is run alone, never padded into a batch, so padding cannot blur the reference.
An MXFP4 checkpoint (gpt-oss as published) is read through transformers' own MXFP4
dequantization (Mxfp4Config(dequantize=True)), its reader of those files on the CPU.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Mxfp4Config, PreTrainedModel

from kvbatch.engine import LLM, SamplingParams


def hf_model(path: str | Path, **kw) -> PreTrainedModel:
    """transformers' model for `path` (a folder, or a .gguf file) in float32, eval, CPU, SDPA.

    Cached per (path, kw): tests share one instance, so never modify what this returns.
    `kw` go to from_pretrained (e.g. attn_implementation="eager") and must be hashable.
    """
    return _load(str(Path(path).resolve()), tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=8)
def _load(path: str, kw: tuple[tuple[str, object], ...]) -> PreTrainedModel:
    options = {"dtype": torch.float32, "attn_implementation": "sdpa", **dict(kw)}
    p = Path(path)
    if p.suffix == ".gguf":
        options["gguf_file"] = p.name
        p = p.parent
    elif _quant_method(p) == "mxfp4":
        options.setdefault("quantization_config", Mxfp4Config(dequantize=True))
    try:
        model = _causal_lm_class(p).from_pretrained(p, **options)
    except ValueError as e:  # Gemma 2 has no SDPA path (its soft-cap): eager is its reference
        if "does not support an attention implementation" not in str(e):
            raise
        model = _causal_lm_class(p).from_pretrained(
            p, **{**options, "attn_implementation": "eager"}
        )
    return model.to("cpu").eval()


NOT_AUTO_MAPPED = {"Mistral4ForCausalLM": transformers.Mistral4ForCausalLM}
"""Causal LMs that transformers' AutoModelForCausalLM does not map (Mistral 4's model type)."""


def _causal_lm_class(folder: Path):
    config = folder / "config.json"
    if folder.is_dir() and config.is_file():
        archs = json.loads(config.read_text()).get("architectures") or []
        for arch in archs:
            if arch in NOT_AUTO_MAPPED:
                return NOT_AUTO_MAPPED[arch]
    return AutoModelForCausalLM


def _quant_method(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")


def hf_greedy(
    path: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    ignore_eos: bool,
    eos_token_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), new tokens only.

    ignore_eos=True: exactly `max_new_tokens` tokens; an EOS token may appear and generation
    goes on past it (vLLM's ignore_eos). ignore_eos=False: stops after the first EOS, which
    is included, as the engine reports it. EOS ids are the checkpoint's generation_config
    ones unless `eos_token_ids` overrides them.
    """
    model = hf_model(path)
    if ignore_eos:
        # eos_token_id=None switches off the EOS stopping criterion. Not min_new_tokens: that
        # masks the EOS logit, so the greedy token would change wherever EOS is the argmax.
        eos = None
    elif eos_token_ids is not None:
        eos = list(eos_token_ids)
    else:
        eos = model.generation_config.eos_token_id
    outs = []
    for prompt in prompts:
        if len(prompt) == 0:
            raise ValueError("hf_greedy needs non-empty prompts")
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=model.generation_config.pad_token_id,
            )
        outs.append(out[0, ids.shape[1] :].tolist())
    if ignore_eos and any(len(o) != max_new_tokens for o in outs):
        raise AssertionError(f"transformers stopped early: {[len(o) for o in outs]}")
    return outs


def hf_logits(path: str | Path, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32, CPU) of one forward over `token_ids`."""
    if len(token_ids) == 0:
        raise ValueError("hf_logits needs at least one token")
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.inference_mode():
        logits = hf_model(path)(ids, attention_mask=torch.ones_like(ids)).logits
    return logits[0].float()


def assert_logprobs_match_transformers(
    path: str | Path, prompt: list[int], *, num_kv_blocks: int, max_model_len: int
) -> None:
    """kvbatch's greedy tokens and their logprobs over three steps equal transformers' log-softmax
    of the same sequence (float32, CPU), to 1e-4."""
    llm = LLM(
        model=str(path), device="cpu", num_kv_blocks=num_kv_blocks, max_model_len=max_model_len
    )
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    lps = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs
    generated = [lp.token_id for lp in lps]
    ref = torch.log_softmax(hf_logits(path, prompt + generated[:2]), -1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == int(row.argmax())
        assert abs(lp.logprob - row[lp.token_id].item()) <= 1e-4, (i, lp, row[lp.token_id])


def assert_greedy_matches_transformers(
    path: str | Path, prompts: list[list[int]], params: SamplingParams, engine_args: dict
) -> None:
    """kvbatch's greedy tokens for `prompts` (which share prefixes) equal transformers', the
    prefix cache was read, a pool small enough to preempt did preempt (`num_kv_blocks` in
    `engine_args`), and the KV manager's invariants hold afterwards."""
    kw = dict(device="cpu", num_kv_blocks=96, max_model_len=256) | engine_args
    llm = LLM(model=str(path), **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    stats = llm.stats()
    assert stats.prefix_hits > 0  # the shared prefixes were read from the cache
    assert stats.num_preemptions > 0 or "num_kv_blocks" not in engine_args
    llm.engine.kv.check_integrity()
