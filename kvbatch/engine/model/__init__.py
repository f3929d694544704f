"""Loading and reading checkpoints: the architecture registry, config features refused by
name, the loader (safetensors, GGUF, MoE experts), RoPE frequencies, the MoE block, encoders."""
