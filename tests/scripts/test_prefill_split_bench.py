"""scripts/prefill_split_bench.py on the CPU (the Triton interpreter): every split count gives
the unsplit output, and the automatic choice is among the rows."""

from __future__ import annotations

from tests.scripts import load_script


def test_split_bench_checks_every_split_against_the_unsplit_output(capsys):
    bench = load_script("prefill_split_bench")
    argv = "--device cpu --context 1100 --chunks 4 --splits 1,3 --kv-heads 1 --group 2"
    assert bench.main([*argv.split(), "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[1] for r in rows] == ["1", "3", "auto"]
    assert rows[2][2] == "2"  # 1100 keys, one row tile: two splits of >= 512 keys
    assert all(float(r[-1]) <= 1e-5 for r in rows)
    assert "prefill splits ok" in out
