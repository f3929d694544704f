"""`python -m studies host-overhead` on a handful of requests."""

from __future__ import annotations

import json

from studies.host_overhead import PHASES, measure
from studies.registry import run


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
    assert run(["host-overhead", "--requests", "4", "--output-len", "3", "--json", str(out)]) == 0
    assert "| prepare |" in capsys.readouterr().out
    assert json.loads(out.read_text())["decode_steps"] == 2


def test_a_long_prompt_s_steps_are_profiled_apart_from_plain_ones(tmp_path, capsys):
    out = tmp_path / "long.json"
    argv = ["host-overhead", "--long-prompt", "600", "--requests", "3", "--chunk-tokens", "64"]
    assert run([*argv, "--long-decode-steps", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| phase | plain step (median ms) | with a chunk (median ms) |" in printed
    assert "| long decoding (median ms) | long decoding (max ms) |" in printed
    r = json.loads(out.read_text())
    assert r["decoders"] == 3 and r["long_prompt_len"] == 600 and r["plain_steps"] == 10
    # 600 tokens in chunks of at most 64 tokens' worth: at least 10 steps with a chunk
    assert r["mixed_steps"] >= 600 // 64
    assert r["long_decoding_steps"] == 5
    for phases in (
        r["plain_ms_per_step"],
        r["mixed_ms_per_step"],
        r["mixed_max_ms"],
        r["long_decoding_ms_per_step"],
        r["long_decoding_max_ms"],
    ):
        assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
    assert r["add_request_ms"] > 0
