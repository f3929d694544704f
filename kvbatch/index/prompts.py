"""The generation stages' default prompts. Each puts the whole document first, so every chunk's
prompt of one document starts with the same tokens: the document is a shared prefix that the
engine prefills once (the prefix grouping keeps a document's chunks together)."""

from __future__ import annotations

# Anthropic's contextual-retrieval prompt ("Introducing Contextual Retrieval", 2024), verbatim
# but for the placeholders.
CONTEXT_PROMPT = """<document>
{document}
</document>
Here is the chunk we want to situate within the whole document
<chunk>
{chunk}
</chunk>
Please give a short succinct context to situate this chunk within the overall document for the purposes of improving search retrieval of the chunk. Answer only with the succinct context and nothing else."""

QUESTIONS_PROMPT = """<document>
{document}
</document>
Here is a chunk of the document
<chunk>
{chunk}
</chunk>
Write {n} short questions that this chunk answers, one per line, with no numbering and nothing else."""

SUMMARY_PROMPT = """<document>
{document}
</document>
Summarize the document above in two or three sentences. Answer only with the summary."""
