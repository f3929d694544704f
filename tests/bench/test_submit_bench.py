"""`kvbatch bench submit-lines`: a row in its own process, submit and `--run` alike, with
the malformed line reported by its number and (for a run) every other line answered in input
order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.bench import submit_bench


@pytest.mark.slow  # four processes, each loading a tokenizer or a model
def test_submit_and_run_rows(tmp_path: Path, smollm2_dir: Path, capsys):
    common = ["--lines", "300", "--bad-line", "200", "--workdir", str(tmp_path / "work"),
              "--model", str(smollm2_dir), "--shard-tokens", "5000"]  # fmt: skip
    assert submit_bench.main([*common, "--json", str(tmp_path / "submit.json")]) == 0
    submitted = json.loads((tmp_path / "submit.json").read_text())
    assert [(r["lines"], r["requests"], r["invalid"], r["error_lines"]) for r in submitted] == [
        (300, 299, 1, [200])
    ]
    assert all(r["shards"] >= 1 and r["peak_rss_mb"] > 0 for r in submitted)

    assert submit_bench.main([*common, "--run", "--json", str(tmp_path / "run.json")]) == 0
    ran = json.loads((tmp_path / "run.json").read_text())
    rows = [(r["lines"], r["answered"], r["in_order"], r["invalid"], r["error_lines"])
            for r in ran]  # fmt: skip
    assert rows == [(300, 299, True, 1, [200])]
    table = capsys.readouterr().out
    assert "answered (in order)" in table and "299 (yes)" in table
    # The run's jobs have greedy lines of max_tokens 1; submit's keep theirs.
    body = json.loads((tmp_path / "work" / "chat-300-bad200-max1-greedy.jsonl").open().readline())
    assert (body["body"]["max_tokens"], body["body"]["temperature"]) == (1, 0.0)
