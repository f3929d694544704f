"""`kvbatch bench chunk-padding` (benchmarks/chunk_padding.py): the simulated 32k prefill."""

from __future__ import annotations

import json

import pytest

from kvbatch.bench import cli


def test_the_table_compares_bucket_sets_and_what_the_loop_is_charged_for(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert cli.main(["chunk-padding", "--prompt-len", "16384", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "a 16384-token prompt beside 64 decoders" in text and "longest gap (plain steps)" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 24 and {r["buckets"] for r in rows} == {"doubling", "1.5x"}
    charged_rows = [r for r in rows if r["charged"] == "rows"]
    charged_tokens = [r for r in rows if r["charged"] == "tokens"]
    assert max(r["longest_over_budget"] for r in charged_rows) <= 1.05
    assert all(r["eager_steps"] == 0 for r in charged_rows)  # never past the last bucket
    assert any(r["eager_steps"] > 0 for r in charged_tokens)  # at 2 us a row they went past
    assert max(r["longest_over_budget"] for r in charged_tokens) > 1.1
    for r in rows:
        assert r["longest_gap_plain_steps"] == 1 + 1.5 * r["longest_over_budget"]
        assert r["steps"] > 8 and 0 < r["mean_over_budget"] <= r["longest_over_budget"]


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["chunk-padding", "--plain-ms", "0"])
    assert "--plain-ms" in capsys.readouterr().err
