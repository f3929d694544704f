"""Queries that name a rare word: an identifier that one page of the corpus holds and no other.

The summary queries of the stdlib corpus are prose ("Command-line parsing library"), where
embeddings shine. Users also search for names: a function, a class, an option. Such a word is
rare, and a sentence embedding of a short query dominated by an unknown identifier carries
little of it, where BM25 weighs a word by how rare it is. For each page, the first identifier
in it (at least 6 characters, with an underscore or a capital after its first letter, so a
code name rather than an English word) that no other page of the corpus contains, and not the
module's own name, makes the query "what is <identifier> for?", its page the relevant one.
Pages without such a word get no query.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from kvbatch.bench.stdlib_corpus import StdlibCorpus

_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{5,}\b")


@dataclass(frozen=True)
class Query:
    text: str
    document_id: str  # the relevant document


def _is_code_name(word: str) -> bool:
    if word.isupper():  # a constant or a shouted word: WARRANTY
        return False
    return "_" in word.strip("_") or any(c.isupper() for c in word[1:])


def identifier_queries(corpus: StdlibCorpus) -> list[Query]:
    words = {d.document_id: set(_IDENTIFIER.findall(d.text)) for d in corpus.documents}
    pages_with = Counter(w for ws in words.values() for w in ws)
    queries = []
    for doc in corpus.documents:
        own = doc.module.split(".")
        for word in _IDENTIFIER.findall(doc.text):
            if pages_with[word] == 1 and _is_code_name(word) and word not in own:
                queries.append(Query(f"what is {word} for?", doc.document_id))
                break
    return queries


def summary_queries(corpus: StdlibCorpus) -> list[Query]:
    return [Query(d.summary, d.document_id) for d in corpus.documents]
