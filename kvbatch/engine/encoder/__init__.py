"""Encoder models (BERT, RoBERTa: engine/model/bert.py) for embeddings, and cross-encoders
(their ...ForSequenceClassification: engine/model/sequence_classifier.py) for pair scores,
beside the paged decoder engine.

An encoder reads each input whole and bidirectionally: no token's state is final before the
last token is seen, so there is nothing to cache between requests, nothing to keep after the
forward, and nothing to gain from chunking a prompt. The paged engine's machinery (KV pool,
prefix cache, chunked prefill, decode graphs) has no work to do, so an encoder checkpoint gets
its own small engine with the same streaming API (LLM picks it for an encoder checkpoint):

    add_embedding_request -> waiting (batches.py) -> step(): one padded batch of requests of
    similar length -> BertModel forward -> pooled (engine/pooling/pooler.py) -> EmbeddingOutput

    add_score_request(query, document) -> the pair as one input of two segments -> step():
    BertModel forward with token types -> classification head -> activation -> ScoreOutput

batches.py picks each step's batch; engine.py is the engine.
"""
