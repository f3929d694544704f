"""Speculative decoding as users see it: `kvbatch run --speculative`, the usage fields of the
output lines, LLM.stats() and the worker's Prometheus counters."""

from __future__ import annotations

import json

import pytest

from tests.engine.spec.test_spec_decode import one_thread  # noqa: F401  (an autouse fixture)


def _job(path, n=4):
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    with open(path, "w") as f:
        for i in range(n):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Repeat: {text} {text} {i}"}],
                "max_tokens": 24,
                "temperature": 0,
            }
            url = "/v1/chat/completions"
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}))
            f.write("\n")


def test_kvbatch_run_reports_accepted_and_rejected_prediction_tokens(tiny_chat_model, tmp_path):
    from kvbatch.cli import main

    _job(tmp_path / "in.jsonl")
    base = ["run", str(tmp_path / "in.jsonl"), "--model", str(tiny_chat_model), "--device", "cpu"]
    assert main(base + ["-o", str(tmp_path / "plain.jsonl")]) == 0
    # The model as its own draft: every draft is accepted but the last ones past a stop.
    spec = ["--speculative", f"draft:{tiny_chat_model}", "--num-speculative-tokens", "3"]
    assert main(base + ["-o", str(tmp_path / "spec.jsonl"), *spec]) == 0
    plain = [json.loads(x) for x in open(tmp_path / "plain.jsonl")]
    lines = [json.loads(x) for x in open(tmp_path / "spec.jsonl")]
    assert [x["response"]["body"]["choices"] for x in lines] == [
        x["response"]["body"]["choices"] for x in plain
    ]
    details = [x["response"]["body"]["usage"]["completion_tokens_details"] for x in lines]
    assert sum(d["accepted_prediction_tokens"] for d in details) > 0
    for d in details:
        assert set(d) == {
            "reasoning_tokens",
            "accepted_prediction_tokens",
            "rejected_prediction_tokens",
        }
    for x in plain:
        d = x["response"]["body"]["usage"]["completion_tokens_details"]
        assert d["accepted_prediction_tokens"] == d["rejected_prediction_tokens"] == 0


def test_bad_speculative_flags_fail_with_the_fix(tiny_chat_model, tmp_path, capsys):
    from kvbatch.cli import main

    _job(tmp_path / "in.jsonl", 1)
    argv = ["run", str(tmp_path / "in.jsonl"), "--model", str(tiny_chat_model), "--device", "cpu"]
    assert main(argv + ["--speculative", "eagle"]) == 1
    assert "'ngram' or 'draft:PATH'" in capsys.readouterr().err


def test_stats_and_worker_counters_follow_the_engine(tiny_models):
    from prometheus_client import generate_latest

    from kvbatch.engine import LLM, SamplingParams
    from kvbatch.worker.metrics import WorkerMetrics

    path = str(tiny_models("llama-gqa"))
    llm = LLM(
        model=path, device="cpu", num_kv_blocks=32, max_model_len=128, speculative=f"draft:{path}"
    )
    prompt = list(range(3, 40))
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stats = llm.stats()
    assert out.spec_stats.num_draft_tokens == stats.spec_draft_tokens > 0
    assert stats.spec_acceptance_rate == 1.0 and out.spec_stats.mean_accepted_length > 1
    assert len(stats.spec_acceptance_by_position) == 4
    m = WorkerMetrics()
    m.observe_engine(llm)
    text = generate_latest(m.registry).decode()
    assert f"kvbatch_spec_decode_draft_tokens_total {float(stats.spec_draft_tokens)}" in text
    assert f"kvbatch_spec_decode_accepted_tokens_total {float(stats.spec_accepted_tokens)}" in text


@pytest.mark.parametrize("value", [None, "ngram"])
def test_llm_without_speculation_reports_no_spec_stats(tiny_models, value):
    from kvbatch.engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32,
              max_model_len=128, speculative=value)  # fmt: skip
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))[0]
    if value is None:
        assert out.spec_stats is None and llm.engine.config.speculative is None
    assert llm.stats().spec_draft_tokens == (
        out.spec_stats.num_draft_tokens if out.spec_stats else 0
    )
