"""scripts/prefill_split_bench.py on the CPU (the Triton interpreter): every split count gives
the unsplit output, for a chunk after a long context and for the cascade shape, and the
automatic choice is among the rows."""

from __future__ import annotations

from tests.scripts import load_script

ARGS = (
    "--device cpu --context 1100 --chunks 4 --splits 1,3 --kv-heads 1 --group 2 --head-dim 16 "
    "--cascade-groups 2 --cascade-rows 3 --cascade-keys 600"
)


def test_split_bench_checks_every_split_against_the_unsplit_output(capsys):
    bench = load_script("prefill_split_bench")
    assert bench.main(ARGS.split()) == 0
    out = capsys.readouterr().out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.startswith("  ") and ("e-" in line or "e+" in line)
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("4", "1"), ("4", "3"), ("4", "auto"), ("3x600", "1"), ("3x600", "3"), ("3x600", "auto")
    ]  # fmt: skip
    assert rows[2][2] == "2"  # 1100 keys, one row tile: two splits of >= 512 keys
    assert rows[5][2] == "1"  # 600 shared keys: one split (< 2 x 512)
    assert all(float(r[-1]) <= 1e-5 for r in rows)
    assert "cascade: 2 groups x 3 decode rows against 600 shared keys" in out
    assert "prefill splits ok" in out
