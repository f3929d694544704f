"""Windows of a long document for the generation prompts.

Each generation prompt holds the document and (context, questions) one chunk. A document whose
prompt would not fit the generation model's context (`max_model_len`, less the answer's
max_tokens) is given in part: a window of WINDOW tokens of it around the chunk. The chunk is
always in the prompt whole; the window takes the rest of the budget from the document.

Windows start on fixed strides from the document's start (WINDOW less the longest chunk, so
that a chunk near the middle of its window lies inside it, or WINDOW / 2 if that is more),
and a chunk gets the window whose middle is nearest its own: neighbouring chunks get the same
window, so the same prompt prefix, and the engine prefills each window once for all of its
chunks (the document-once property, per window). The summary of a windowed document is of its first
window. A document that fits is given whole, as before: its prompts do not change.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvbatch.index.chunking import Chunk
from kvbatch.index.spec import StagesSpec

MARGIN = 16  # tokens kept free: text tokenized in pieces can take a few more tokens joined
MIN_WINDOW = 64  # a window shorter than this says too little about the document


class WindowError(ValueError):
    """The generation model's context leaves too little room for a window of the document."""


@dataclass(frozen=True)
class WindowBudget:
    """What a document's prompts may spend, in the generation model's tokens."""

    tokenizer: object  # the generation model's (a transformers tokenizer)
    max_model_len: int
    overhead: int  # the most tokens a stage's prompt takes without document and chunk, with
    # its chat template, plus its answer's max_tokens

    @classmethod
    def for_stages(cls, tokenizer, max_model_len: int, stages: StagesSpec) -> WindowBudget:
        overhead = 0
        for stage in (stages.context, stages.questions, stages.summary):
            if stage is None:
                continue
            fields = {"document": "", "chunk": "", "n": getattr(stage, "n", 0)}
            empty = stage.prompt.format(**fields)
            overhead = max(overhead, _chat_tokens(tokenizer, empty) + stage.max_tokens)
        return cls(tokenizer, max_model_len, overhead + MARGIN)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


@dataclass(frozen=True)
class DocumentWindows:
    """The text each prompt of one document holds in place of the whole document."""

    text: str
    chunks: list[Chunk]
    window_texts: list[str]  # empty when the document is given whole
    chunk_window: dict[str, int]  # chunk id -> its window's index

    @property
    def windowed(self) -> bool:
        return bool(self.window_texts)

    def for_chunk(self, chunk: Chunk) -> str:
        if not self.windowed:
            return self.text
        return self.window_texts[self.chunk_window[chunk.chunk_id]]

    def for_summary(self) -> str:
        return self.window_texts[0] if self.windowed else self.text


def document_windows(text: str, chunks: list[Chunk], budget: WindowBudget) -> DocumentWindows:
    """The whole document when every prompt fits; else its windows (module docstring).
    WindowError when the budget leaves less than MIN_WINDOW tokens beside the longest chunk."""
    encoded = budget.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    longest_chunk = max((budget.count(c.text) for c in chunks), default=0)
    room = budget.max_model_len - budget.overhead - longest_chunk
    if len(offsets) <= room:
        return DocumentWindows(text, chunks, [], {})
    if room < MIN_WINDOW:
        raise WindowError(
            f"the generation model's context ({budget.max_model_len} tokens, less "
            f"{budget.overhead} for the prompt and its answer) leaves {room} tokens beside a "
            f"chunk of {longest_chunk}: raise [engine] max_model_len, or lower chunking.size "
            "or the stages' max_tokens"
        )
    size = room
    stride = max(1, size // 2, size - longest_chunk)
    last_start = len(offsets) - size
    starts = [*range(0, last_start, stride), last_start]
    ends = [o[1] for o in offsets]
    window_texts = [text[offsets[s][0] : offsets[s + size - 1][1]] for s in starts]
    chunk_window = {}
    for chunk, (a, b) in zip(chunks, _chunk_spans(text, chunks), strict=True):
        middle = (bisect.bisect_left(ends, a) + bisect.bisect_left(ends, b)) / 2
        nearest = min(range(len(starts)), key=lambda i: abs(starts[i] + size / 2 - middle))
        chunk_window[chunk.chunk_id] = nearest
    return DocumentWindows(text, chunks, window_texts, chunk_window)


def _chunk_spans(text: str, chunks: list[Chunk]) -> list[tuple[int, int]]:
    """Each chunk's (start, end) characters in the text, found in order. A chunk the chunker
    packed from sections (joined anew) is found by its first line; failing that it is placed
    where the chunk before it ended."""
    spans = []
    cursor = 0
    for chunk in chunks:
        head = chunk.text.split("\n", 1)[0][:80]
        at = text.find(head, cursor) if head else -1
        start = at if at >= 0 else cursor
        end = min(len(text), start + len(chunk.text))
        spans.append((start, end))
        cursor = start + 1
    return spans


def _chat_tokens(tokenizer, content: str) -> int:
    """Tokens of a user message with the chat template and the generation prompt, as the
    generation job tokenizes it."""
    messages = [{"role": "user", "content": content}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    return len(tokenizer(content).input_ids)
