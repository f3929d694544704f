"""A document longer than the generation model's context: its prompts hold a window of it
around each chunk (the chunk whole), windows on fixed strides shared by neighbouring chunks.
SmolLM2's tokenizer and chat template (a tiny random chat model), all-MiniLM-L6-v2's chunks."""

from __future__ import annotations

import pytest

from kvbatch.index.chunking import Chunker
from kvbatch.index.generate import generation_lines
from kvbatch.index.pipeline import run_index
from kvbatch.index.plan import WorkDocument
from kvbatch.index.spec import StagesSpec, load_spec
from kvbatch.index.windows import WindowBudget, WindowError, document_windows
from kvbatch.jobs.model_info import load_tokenizer
from tests.index.indexing import table_rows

WORDS = ["gale", "calm", "squall", "breeze", "storm", "drizzle", "fog"]


def harbour_log(days: int) -> str:
    """A long plain document of distinct paragraphs."""
    return "\n\n".join(
        f"Day {d} of the harbour log. The wind was a {WORDS[d % 7]} from the "
        f"{['north', 'south', 'east', 'west'][d % 4]}, and {d * 7 % 13} ships entered port "
        f"while {d * 5 % 11} left for the fishing grounds beyond the {WORDS[(d + 3) % 7]} line."
        for d in range(days)
    )


def chat_prompt_tokens(tokenizer, content: str) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_windows_hold_each_chunk_whole_fit_the_context_and_are_shared(
    tiny_chat_model, minilm_tokenizer
):
    text = harbour_log(90)
    tokenizer = load_tokenizer(str(tiny_chat_model))
    assert len(tokenizer(text).input_ids) > 3000
    chunks = Chunker.for_tokenizer(minilm_tokenizer, 200, 0).chunk("log.txt", text)
    stages = StagesSpec.model_validate({"context": {}, "summary": {"max_tokens": 50}})
    budget = WindowBudget.for_stages(tokenizer, 1024, stages)
    windows = document_windows(text, chunks, budget)
    assert windows.windowed
    used = {windows.chunk_window[c.chunk_id] for c in chunks}
    assert len(used) < len(chunks)  # neighbouring chunks share a window
    for chunk in chunks:
        window = windows.for_chunk(chunk)
        assert chunk.text in window and window in text
    docs = [WorkDocument("log.txt", "log.txt", "h", text, chunks)]
    lines = list(generation_lines(docs, stages, "m", {"log.txt": windows}))
    assert len(lines) == len(chunks) + 1
    for line in lines:
        prompt = line["body"]["messages"][0]["content"]
        room = 1024 - line["body"]["max_tokens"]
        assert chat_prompt_tokens(tokenizer, prompt) <= room
    # a short document is given whole, its prompts as before
    short = document_windows(chunks[0].text, chunks[:1], budget)
    assert not short.windowed and short.for_chunk(chunks[0]) == chunks[0].text


def test_a_context_too_small_for_any_window_is_named(tiny_chat_model, minilm_tokenizer):
    text = harbour_log(40)
    tokenizer = load_tokenizer(str(tiny_chat_model))
    chunks = Chunker.for_tokenizer(minilm_tokenizer, 200, 0).chunk("log.txt", text)
    budget = WindowBudget.for_stages(tokenizer, 400, StagesSpec.model_validate({"context": {}}))
    with pytest.raises(WindowError, match="raise \\[engine\\] max_model_len"):
        document_windows(text, chunks, budget)


@pytest.mark.slow
def test_a_document_longer_than_the_context_gets_every_row_and_context(
    tmp_path, tiny_chat_model, minilm
):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "log.txt").write_text(harbour_log(90))
    (docs / "short.txt").write_text("The harbour was closed for a day in the great storm.")
    spec_file = tmp_path / "index.toml"
    spec_file.write_text(
        f'[source]\npath = "{docs}"\n[chunking]\nsize = 200\n'
        f'[models]\ngeneration = "{tiny_chat_model}"\nembedding = "{minilm}"\n'
        "[stages.context]\nmax_tokens = 6\n"
        f'[output]\nuri = "{tmp_path / "index"}"\n'
        '[engine]\ndevice = "cpu"\nmax_num_seqs = 4\nmax_model_len = 1024\n'
    )
    report = run_index(load_spec(spec_file))
    assert report.errors == [] and report.documents_windowed == 1
    rows = table_rows(load_spec(spec_file))
    log_rows = [r for r in rows if r["document_id"] == "log.txt"]
    assert len(log_rows) > 10 and all(r["context"] for r in rows)
    assert report.chunks == len(rows)
    p = report.prefill
    assert p.computed == p.ideal  # each window once for all of its chunks
    assert p.ideal < p.no_sharing * 0.75
