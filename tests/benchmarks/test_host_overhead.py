"""`kvbatch bench host-overhead` on a handful of requests."""

from __future__ import annotations

import json

from benchmarks.cli import main
from benchmarks.host_overhead import PHASES, measure


def test_every_decode_step_is_split_into_phases():
    r = measure(requests=8, output_len=5)
    assert r["requests"] == 8
    # the first output token comes with the prefill; the other four are decode steps
    assert r["decode_steps"] == 4
    ms = r["ms_per_step"]
    assert set(ms) == set(PHASES)
    assert all(v >= 0 for v in ms.values())
    assert r["host_ms_per_step"] == sum(v for k, v in ms.items() if k != "forward")


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["host-overhead", "--requests", "4", "--output-len", "3", "--json", str(out)]) == 0
    assert "| prepare |" in capsys.readouterr().out
    assert json.loads(out.read_text())["decode_steps"] == 2
