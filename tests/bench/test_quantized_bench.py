"""The benchmarks' quantized runs on the CPU: --weights w4a16 (random weights rounded to 4 bits
and written as a GPTQ checkpoint that the engine's own GPTQ loader reads), --quantization fp8
and --kv-cache-dtype fp8, with the table's memory line; and the decode-small-batch workload."""

from __future__ import annotations

import json

import pytest
import torch

from kvbatch.bench import cli
from kvbatch.bench.fp8_block import fp8_block_quantization_config, fp8_block_tensors
from kvbatch.bench.models import TINY_LLAMA, random_model_dir
from kvbatch.bench.rtn_w4a16 import GROUP_SIZE, gptq_tensors
from kvbatch.bench.workloads import get_workload
from kvbatch.engine.quant.detect import detect_quantization
from kvbatch.engine.quant.fp8_checkpoint import load_fp8_linear
from kvbatch.engine.quant.gptq import gptq_weights
from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.scheme import WNA16


@pytest.mark.parametrize("k", [64, GROUP_SIZE * 2, GROUP_SIZE + 64])  # one, two, ragged groups
def test_rounding_is_read_back_by_the_gptq_loader_within_half_a_step(k):
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(k)) * 0.02
    w[3, :] = 0.0  # an all-zero channel gets a finite scale
    t = LayerTensors("layer", "gptq", gptq_tensors(w))
    scheme = WNA16(bits=4, group_size=GROUP_SIZE, symmetric=True)
    back = gptq_weights(t, scheme, torch.float32, zeros_minus_one=False).dequantize()
    step = w.abs().amax() / 7
    assert back.shape == w.shape
    assert (back - w).abs().max() <= step * 0.51  # fp16 scales: a hair over half a step
    assert torch.equal(back[3], torch.zeros(k))


def test_w4a16_model_is_cached_apart_and_says_its_format(random_cache):
    float_dir = random_model_dir(TINY_LLAMA)
    w4_dir = random_model_dir(TINY_LLAMA, weights="w4a16")
    assert float_dir != w4_dir
    config = json.loads((w4_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert "quantization_config" not in json.loads((float_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="weights must be one of"):
        random_model_dir(TINY_LLAMA, weights="w3a16")


@pytest.mark.parametrize(
    "flags, weights_line",
    [
        (["--weights", "w4a16"], "(gptq); KV cache float32"),
        (
            ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--peers", "hf-static"],
            "(fp8); KV cache float8_e4m3fn",
        ),
    ],
)
def test_quantized_rows_run_and_report_their_memory(random_cache, capsys, flags, weights_line):
    assert cli.main(["no-share-gpu", "--tiny", *flags]) == 0
    out = capsys.readouterr().out
    assert "kvbatch memory: weights" in out and weights_line in out
    assert "blocks x 16 =" in out


def test_decode_small_batch_runs_one_sequence_at_a_time(random_cache, capsys):
    w = get_workload("decode-small-batch")
    assert (w.num_requests, w.shared, w.model) == (8, False, "llama-3.1-8b-8-layers-random")
    args = ["decode-small-batch", "--tiny", "--max-num-seqs", "1", "--weights", "w4a16"]
    assert cli.main(args) == 0
    assert "decode-small-batch-tiny: 8 requests" in capsys.readouterr().out


def test_w4a16_weights_refuse_a_model_path_and_peers(tmp_path, capsys):
    assert cli.main(["rag", "--tiny", "--model", str(tmp_path), "--weights", "w4a16"]) == 2
    assert "--weights w4a16 applies to the random models" in capsys.readouterr().err
    assert cli.main(["rag", "--tiny", "--weights", "w4a16", "--peers", "hf-static"]) == 2
    assert "drop --peers hf-static" in capsys.readouterr().err
    assert cli.main(["rag", "--tiny", "--weights", "w4a16", "--quantization", "fp8"]) == 2
    assert "is already quantized: drop --quantization fp8" in capsys.readouterr().err


def test_moe_spec_builds_qwen3_moe_with_its_own_head_dim():
    from kvbatch.bench.models import QWEN3_30B_A3B_4_LAYERS, TINY_QWEN3_MOE

    config = QWEN3_30B_A3B_4_LAYERS.config()
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (128, 8, 128)
    # 4 layers of 128 experts x 3 x 2048 x 768 dominate: about 3.1 B parameters
    assert 3.0e9 < QWEN3_30B_A3B_4_LAYERS.num_parameters() < 3.2e9
    assert TINY_QWEN3_MOE.key() != TINY_LLAMA.key()


def test_rag_moe_runs_against_transformers(random_cache, capsys):
    assert cli.main(["rag-moe", "--tiny", "--peers", "hf-static"]) == 0
    out = capsys.readouterr().out
    assert "rag-moe-tiny:" in out and "model qwen3-moe-tiny-random" in out
    assert "hf-static" in out and "4/4" in out  # greedy tokens equal transformers'


@pytest.mark.parametrize(("shape", "block"), [((256, 384), 128), ((48, 64), 32), ((40, 70), 32)])
def test_fp8_block_writer_is_read_back_within_fp8_rounding(shape, block):
    """--weights fp8-block: tiles of `block` (partial ones too), each scaled to E4M3's range;
    the engine's block-FP8 loader dequantizes them to within E4M3's rounding of each tile."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(block)) * 0.02
    tensors = fp8_block_tensors(w, block)
    rows, cols = -(-shape[0] // block), -(-shape[1] // block)
    assert tensors["weight_scale_inv"].shape == (rows, cols)
    config = detect_quantization({"quantization_config": fp8_block_quantization_config(block)})
    layer = load_fp8_linear(
        LayerTensors("layer", "fp8", tensors), config.scheme_for("x"), torch.float32
    )
    back = layer.dequantize(torch.float32)
    assert back.shape == w.shape
    assert ((back - w).abs() <= w.abs() * 2**-3 + 1e-6).all()  # E4M3: 3 mantissa bits


def test_fp8_block_rows_run(random_cache, capsys):
    assert cli.main(["rag-moe", "--tiny", "--weights", "fp8-block"]) == 0
    assert "(fp8); KV cache float32" in capsys.readouterr().out
