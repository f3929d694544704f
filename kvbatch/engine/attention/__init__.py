"""Attention over the paged KV cache: the step's metadata and the torch and Triton backends."""
