"""Index metrics per stage: what run_index counts into a Prometheus registry, read back with
prometheus_client itself, and `kvbatch index --metrics-port` serving them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvbatch.index.metrics import IndexMetrics
from kvbatch.index.pipeline import run_index
from tests.index.indexing import WatchedModels, index_spec, table_rows


def _value(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.slow
def test_each_stage_is_counted_and_a_rerun_counts_as_up_to_date(tmp_path, docs_folder, minilm):
    spec = index_spec(tmp_path, docs_folder, None, minilm)
    registry = CollectorRegistry()
    metrics = IndexMetrics(registry)
    report = run_index(spec, llm_factory=WatchedModels(), metrics=metrics)
    rows = table_rows(spec)
    for stage in ("plan", "embed", "write"):
        assert _value(registry, "kvbatch_index_documents_total", stage=stage) == 4, stage
        assert _value(registry, "kvbatch_index_chunks_total", stage=stage) == len(rows), stage
        assert _value(registry, "kvbatch_index_stage_seconds_total", stage=stage) > 0, stage
    assert _value(registry, "kvbatch_index_documents_total", stage="generate") == 0
    assert _value(registry, "kvbatch_index_runs_total", outcome="merged") == 1
    assert report.chunks == len(rows)
    run_index(spec, llm_factory=WatchedModels(), metrics=metrics)
    assert _value(registry, "kvbatch_index_runs_total", outcome="up_to_date") == 1
    assert _value(registry, "kvbatch_index_documents_total", stage="plan") == 4  # none again


def test_progress_and_prefill_are_set_from_a_status_and_a_report():
    from kvbatch.index.report import IndexReport, PrefillTokens

    registry = CollectorRegistry()
    metrics = IndexMetrics(registry)
    status = {"completed": 5, "failed": 1, "running_finished": 2, "shards_done": 1,
              "shards_total": 3, "requests": 12, "output_tokens": 40}  # fmt: skip
    metrics.progress("generate", status)
    assert _value(registry, "kvbatch_index_stage_progress", stage="generate",
                  what="requests_done") == 8  # fmt: skip
    assert _value(registry, "kvbatch_index_stage_progress", stage="generate",
                  what="shards_total") == 3  # fmt: skip
    metrics.finished(IndexReport(prefill=PrefillTokens(computed=90, ideal=90, no_sharing=200)))
    assert _value(registry, "kvbatch_index_prefill_tokens_total", kind="computed") == 90
    assert _value(registry, "kvbatch_index_prefill_tokens_total", kind="no_sharing") == 200
    assert _value(registry, "kvbatch_index_runs_total", outcome="up_to_date") == 1


def test_a_busy_metrics_port_is_refused_before_any_work(tmp_path, capsys):
    import socket

    from kvbatch.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["index", str(tmp_path / "missing.toml"), "--metrics-port", str(port)])
    assert code == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err
