"""The transformer forward, its fused layers, rotary embeddings and the checkpoint loader."""
