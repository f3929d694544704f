"""The static-buffer path of CUDA graphs run eagerly, for the models' own tests: a step's rows
are padded to the graph's batch bucket, the padding rows go through every layer (routers and
expert kernels, fused norms) beside the real ones, and fresh buffers are full of NaN, so a real
row that reads anything padding or unwritten answers differently."""

from __future__ import annotations

from kvbatch.engine import LLM, SamplingParams
from tests.engine.attention.test_triton_backend import poison_new_float_tensors
from tests.engine.core.test_llm import tokens


def padded_graph_tokens(
    path, prompts: list[list[int]], params: SamplingParams, monkeypatch, **engine_args
) -> list[list[int]]:
    """Greedy tokens of `prompts` (at most 4) through the padded decode-graph path with the
    triton backend, float32 on the CPU (the interpreter); checks that padded steps ran and
    the KV cache is intact."""
    args = dict(device="cpu", dtype="float32", cascade_attention=False) | engine_args
    llm = LLM(str(path), attention_backend="triton", **args)
    llm.engine.runner.capture_step_graphs(max_batch=4, max_model_len=64, capture=False)
    replays = []
    graphs = llm.engine.runner.step_graphs
    real_run = graphs.run
    graphs.run = lambda key, ids, *a: replays.append(ids.shape[0]) or real_run(key, ids, *a)
    poison_new_float_tensors(monkeypatch)
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert replays and max(replays) == len(prompts)
    llm.engine.kv.check_integrity()
    return got
