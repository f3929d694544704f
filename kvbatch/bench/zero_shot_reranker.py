"""A real model to rerank with where no reranker weights can be had: SmolLM2-135M-Instruct asked
Qwen3-Reranker's question ("does the Document meet the Query? yes or no") through a chat
template of that form, scored by its yes/no logits (kvbatch.engine.pooling.yes_no).

It was never trained to rerank, so its figures measure the reranking path on a real model,
not what a trained reranker (bge-reranker, Qwen3-Reranker) would add: the benchmark says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvbatch.fetch import smollm2_dir

ZERO_SHOT_RERANKER = "SmolLM2-135M-Instruct as a zero-shot yes/no reranker"

TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a question about a Python module, is this passage from "
    "that module's documentation?\n"
    '<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") '
    "| first }}\n"
    '<Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") '
    "| first }}<|im_end|>\n<|im_start|>assistant\n"
)


def zero_shot_reranker(into: Path) -> Path:
    """A folder of SmolLM2's files (linked, not copied) with the reranker's chat template."""
    src = Path(smollm2_dir())
    folder = Path(into) / "smollm2-yes-no-reranker"
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and f.name not in ("chat_template.jinja",)
            and not (folder / f.name).exists()
        ):
            os.symlink(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder
