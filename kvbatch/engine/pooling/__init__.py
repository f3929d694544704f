"""Embeddings: the pooling a checkpoint declares, and the prefill-only path that computes it.

config.py reads sentence-transformers' files (modules.json, 1_Pooling/config.json, Normalize);
pooler.py pools the final hidden states on the device, chunk by chunk; inputs.py reads OpenAI's
`input` shapes; matryoshka.py truncates to `dimensions`; outputs.py is what the engine hands
back. The `/v1/embeddings` response body is the jobs layer's
(kvbatch.jobs.openai_format.embedding_body).

The engine side: LLMEngine.add_embedding_request queues a Sequence with `pooling` set; the
scheduler prefills it like any prompt (chunked, from prefix hits when
Sequence.takes_prefix_hits); the runner runs such steps eagerly with the final hidden states
kept, drops the pooling rows before sampling, and hands finished vectors back with the step's
tokens; the engine then frees the request's blocks (full ones stay in the prefix cache).
Encoder checkpoints (BERT) skip all of that: engine/encoder/ runs each input whole and feeds
its rows to the same Pooler in one chunk.
"""
