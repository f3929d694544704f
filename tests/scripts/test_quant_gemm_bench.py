"""scripts/quant_gemm_bench.py on the CPU (the Triton interpreter): every method's row is
printed for every shape and batch, each within its error bound of the float GEMM of the same
quantized weights."""

from __future__ import annotations

from tests.scripts import load_script


def test_quant_gemm_bench_checks_every_method(capsys):
    bench = load_script("quant_gemm_bench")
    assert bench.main("--device cpu --shapes 256x128,200x72 --batches 1,5".split()) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    rows = [r for r in rows if len(r) == 6 and r[2] in bench.METHODS]
    assert len(rows) == 2 * 2 * len(bench.METHODS)
    for shape, _, method, _, _, error in rows:
        assert float(error) <= bench.TOLERANCE[method], (shape, method, error)
    assert "quantized GEMMs ok" in out


def test_unknown_method_is_named(capsys):
    bench = load_script("quant_gemm_bench")
    assert bench.main("--device cpu --shapes 32x16 --batches 1 --methods w3".split()) == 2
    assert "unknown methods ['w3']" in capsys.readouterr().out
