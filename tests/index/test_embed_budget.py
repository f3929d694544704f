"""The embedding input of a chunk and its context fits all-MiniLM-L6-v2's 256 tokens: the
context is cut from its end, never the chunk."""

from __future__ import annotations

from kvbatch.index.embed_budget import EmbeddingBudget


def test_what_fits_is_joined_whole(minilm_tokenizer):
    budget = EmbeddingBudget(minilm_tokenizer, 256)
    assert budget.special_tokens == 2 and budget.chunk_tokens == 254
    assert budget.input_for("The chunk.", "Its context.") == "Its context.\n\nThe chunk."
    assert budget.input_for("The chunk.", None) == "The chunk."


def test_a_long_context_is_cut_to_fit_and_the_chunk_kept(minilm_tokenizer):
    budget = EmbeddingBudget(minilm_tokenizer, 256)
    chunk = " ".join(f"tide{i}" for i in range(60))
    context = " ".join(f"context{i}" for i in range(200))
    joined = budget.input_for(chunk, context)
    assert joined.endswith("\n\n" + chunk) and joined.startswith("context0")
    assert len(minilm_tokenizer(joined)["input_ids"]) <= 256
    assert len(minilm_tokenizer(joined)["input_ids"]) > 240  # the room is used, not wasted


def test_a_chunk_that_fills_the_input_goes_alone(minilm_tokenizer):
    budget = EmbeddingBudget(minilm_tokenizer, 256)
    chunk = " ".join(["tide"] * 254)
    assert budget.input_for(chunk, "Some context.") == chunk


def test_the_chunk_size_is_capped_by_the_model(minilm_tokenizer):
    budget = EmbeddingBudget(minilm_tokenizer, 256)
    assert budget.chunk_size(200) == 200 and budget.chunk_size(256) == 254
