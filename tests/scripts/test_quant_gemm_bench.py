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


def test_crossover_is_the_last_batch_before_the_fused_kernel_loses():
    bench = load_script("quant_gemm_bench")
    times = {
        1: {"w4a16": 0.01, "w4-deq": 0.05},
        16: {"w4a16": 0.02, "w4-deq": 0.05},
        64: {"w4a16": 0.09, "w4-deq": 0.06},
        256: {"w4a16": 0.05, "w4-deq": 0.08},  # a win past a loss does not count
    }
    assert bench.fused_up_to(times) == 16
    assert bench.fused_up_to({1: {"w4a16": 0.2, "w4-deq": 0.1}}) is None
    lines = bench.crossover_lines({"4096x4096": times, "14336x4096": {1: times[1], 16: times[64]}})
    assert lines[-1] == "WNA16_KERNEL_MAX_BATCH from these shapes: 1"
