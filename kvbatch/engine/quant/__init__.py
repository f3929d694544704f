"""Quantized linear layers: a checkpoint's `quantization_config` (or `quantization="fp8"`) picks
a scheme per layer (scheme.py, detect.py); each format's tensors are converted at load into one
layout per scheme (compressed_tensors.py, gptq.py, awq.py, online_fp8.py); the layers
(linear.py) call one GEMM per scheme (gemm.py), with a dequantizing path on the CPU."""
