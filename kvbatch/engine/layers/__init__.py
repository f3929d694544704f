"""The layers every architecture is built from (engine/model/*.py compose them).

Each layer is one call whose kernel depends on the backend the engine picked: a plain-torch
path (`forward_torch`, any device) and a Triton path (`forward_triton`, kvbatch.kernels; the
triton attention backend turns it on with `use_kernels`), as vLLM's CustomOp chooses
`forward_native` or `forward_cuda`. Both paths compute the same sums in the same order:

    kernel_op.py   KernelOp (the choice of path) and use_kernels(model, backend)
    norm.py        RMSNorm, with the residual add fused in, and Gemma's (1 + w) form
    rotary.py      RotaryEmbedding: cos/sin tables, or rotation in place from positions
    linear.py      MergedLinear: q/k/v (or gate/up) as one GEMM over weights merged at load
    activation.py  SiLU-and-mul and GELU(tanh)-and-mul over a merged gate|up output
    mlp.py         the gated MLP (SwiGLU, GeGLU) from the three above
    attention.py   self-attention: merged q/k/v, head norms, rotary, paged attention, o_proj
    moe.py         the mixture-of-experts block: router, stacked experts (fused_moe), shared expert
    logits.py      the final norm and the vocabulary projection of the rows to sample

Quantized linears (engine/quant/linear.py) pick their GEMM the same way.
"""
