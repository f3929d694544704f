"""The part of the validation pass that needs no other line: a chunk of raw input lines judged
at once, in the submitting process or in a pool of processes (kvbatch.jobs.local.line_pool).

Each line is validated once (`check_line`), its prompt rendered, and the chunk's prompts
encoded in one call of the fast tokenizer (kvbatch.jobs.openai_format.prompt_batch). What
depends on the lines before it (a duplicate custom_id, the job's endpoint and model, lines an
earlier run answered) is settled by the caller in line order (prepare.scan_lines); a line
that turns out a duplicate there is judged again with the set of ids seen, so its record is
the one `validate_lines` gives.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from kvbatch.engine import NO_REASONING_PARSER, detect_reasoning_parser
from kvbatch.jobs.local.options import RunOptions
from kvbatch.jobs.openai_format.prompt_batch import prompts_token_ids
from kvbatch.jobs.openai_format.prompts import (
    PromptError,
    embedding_token_ids,
    prompt_token_ids,
    sampling_params_for,
)
from kvbatch.jobs.openai_format.score_prompts import pair_token_ids
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, check_line

Tokenized = tuple[JobRequest, list[list[int]]]  # the request (text dropped), its inputs' ids


@dataclass(frozen=True)
class LineRules:
    """What judging a line needs of the job's options (small, so a pool's processes get it)."""

    model_name: str | None
    tool_call_parser: str | None
    reasoning_parser: str | None  # --reasoning-parser as given; None: the tokenizer's

    @classmethod
    def of(cls, opts: RunOptions) -> LineRules:
        return cls(opts.model_name, opts.tool_call_parser, opts.engine.get("reasoning_parser"))


@dataclass(frozen=True)
class JudgedLine:
    """One non-blank line: validation's record, the custom_id it takes (validate_lines adds it
    to the ids seen), its digest, and its tokens (None: not tokenized, being an error or
    skipped as answered)."""

    number: int
    taken: str | None
    record: JobRequest | LineError
    digest: str
    tokens: Tokenized | PromptError | None = None


class _OwnId:
    """validate's set of custom_ids seen, for a line judged apart: empty (the caller settles
    duplicates in order); it remembers the id the line takes."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken: str | None = None

    def __contains__(self, custom_id: object) -> bool:
        return False

    def add(self, custom_id: str) -> None:
        self.taken = custom_id


class ChunkJudge:
    """Judges chunks of lines against one model (`tokenizer`, `max_model_len`; asked only when
    a line needs them), sharing equal SamplingParams between lines."""

    def __init__(self, rules: LineRules, model) -> None:
        self.rules, self.model = rules, model
        self.params_seen: dict = {}  # millions of lines, few kinds of params
        self._reasoning: str | None = None
        self._reasoning_read = False

    def judge(
        self, first: int, raws: list[bytes], skip: frozenset[int] = frozenset()
    ) -> list[JudgedLine | None]:
        """Lines `first`, `first + 1`, ... (1-based): None for a blank line. Lines numbered in
        `skip` are validated but not tokenized (an earlier run may have answered them)."""
        judged: list[JudgedLine | None] = []
        for number, raw in enumerate(raws, start=first):
            own = _OwnId()
            record = check_line(
                number, raw, own, model=self.rules.model_name,
                tool_call_parser=self.rules.tool_call_parser,
            )  # fmt: skip
            judged.append(
                None if record is None else JudgedLine(number, own.taken, record, line_digest(raw))
            )
        todo = [
            i
            for i, j in enumerate(judged)
            if j is not None and isinstance(j.record, JobRequest) and j.number not in skip
        ]
        for i, tokens in zip(todo, self.tokenize([judged[i].record for i in todo])):
            judged[i] = dataclasses.replace(judged[i], tokens=tokens)
        return judged

    def tokenize(self, items: list[JobRequest]) -> list[Tokenized | PromptError]:
        """`tokenized` of each item, the chat and completions prompts encoded in one batch."""
        out: list[Tokenized | PromptError | None] = [None] * len(items)
        text = [i for i, item in enumerate(items) if not item.is_pooled]
        if text:
            model = self.model
            reasoning = (
                self.reasoning() if any(items[i].messages is not None for i in text) else None
            )
            ids_of = prompts_token_ids([items[i] for i in text], model.tokenizer,
                                       model.max_model_len, reasoning)  # fmt: skip
            for i, ids in zip(text, ids_of):
                out[i] = ids if isinstance(ids, PromptError) else self._with_params(items[i], ids)
        for i, item in enumerate(items):
            if item.is_pooled:
                try:
                    out[i] = tokenized(item, self.model)
                except PromptError as e:
                    out[i] = e
        return out

    def reasoning(self) -> str | None:
        """The job's reasoning parser (read once, at the first chat line)."""
        if not self._reasoning_read:
            self._reasoning = job_reasoning_parser(self.rules.reasoning_parser,
                                                   self.model.tokenizer)  # fmt: skip
            self._reasoning_read = True
        return self._reasoning

    def _with_params(self, item: JobRequest, ids: list[int]) -> Tokenized | PromptError:
        try:
            params = sampling_params_for(item, len(ids), self.model.max_model_len)
        except PromptError as e:
            return e
        try:
            params = self.params_seen.setdefault(params, params)
        except TypeError:  # a logit_bias dict makes the params unhashable: not shared
            pass
        return dataclasses.replace(item, messages=None, prompt=None, tools=None,
                                   params=params), [ids]  # fmt: skip


def tokenized(
    item: JobRequest, model, params_seen: dict | None = None, reasoning: str | None = None
) -> Tokenized:
    """(the request with its text dropped, its token ids: one list, or one per embeddings
    input), one line at a time (ChunkJudge.tokenize gives the same for a chunk). Raises PromptError (with the line's own message) when a
    prompt cannot run. `params_seen` shares equal SamplingParams between lines; `reasoning`
    names the job's reasoning parser (gpt-oss prompts are rendered by harmony)."""
    if item.is_embedding:
        inputs = embedding_token_ids(item, model.tokenizer, model.max_model_len)
        return dataclasses.replace(item, inputs=None), inputs
    if item.is_score:
        model_name = item.model or "the model"
        inputs = pair_token_ids(item, model.tokenizer, model.max_model_len, model_name)
        return dataclasses.replace(item, pairs=None), inputs
    ids = prompt_token_ids(item, model.tokenizer, model.max_model_len, reasoning)
    params = sampling_params_for(item, len(ids), model.max_model_len)
    if params_seen is not None:
        try:
            params = params_seen.setdefault(params, params)
        except TypeError:  # a logit_bias dict makes the params unhashable: not shared
            pass
    request = dataclasses.replace(item, messages=None, prompt=None, tools=None, params=params)
    return request, [ids]


def job_reasoning_parser(named: str | None, tokenizer) -> str | None:
    """The name of the reasoning parser the job's engine will use: --reasoning-parser
    (`named`), else the one the model's tokenizer calls for (the engine chooses the same way);
    None: none."""
    if named == NO_REASONING_PARSER:
        return None
    return named or detect_reasoning_parser(tokenizer)


def line_digest(raw: bytes) -> str:
    """What an answer is an answer to: the input line's bytes, outer whitespace aside."""
    return hashlib.sha256(raw.strip()).hexdigest()[:32]
