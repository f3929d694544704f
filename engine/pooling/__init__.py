"""Embeddings: the pooling a checkpoint declares, and the prefill-only path that computes it.

config.py reads sentence-transformers' files (modules.json, 1_Pooling/config.json, Normalize);
pooler.py pools the final hidden states on the device, chunk by chunk; matryoshka.py truncates
to `dimensions`; openai_body.py builds `/v1/embeddings` response bodies.
"""
