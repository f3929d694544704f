"""Turning a valid line into the token ids the engine runs, and into its output cap.

Chat messages go through the model's own chat template (`apply_chat_template`), whose text
already holds the special tokens, so it is encoded without adding any. A line's tools go to the
template too (`tools=`, as vLLM passes them); a template that would drop them, or drop the tool
calls and results of the conversation, is refused rather than run: the model would answer
without ever seeing them. Completions prompts
are encoded as they are (the tokenizer adds what it always adds, e.g. Llama's BOS), or taken
as token ids.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kvbatch import engine
from kvbatch.engine import HARMONY_PARSER, SamplingParams
from kvbatch.jobs.openai_format.tool_parsers import get_parser
from kvbatch.jobs.openai_format.validate import JobRequest, LineError


class PromptError(ValueError):
    """A line whose prompt cannot run: `code` is context_length_exceeded or invalid_prompt."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # pickled whole (a pool's process sends it back)
        return type(self), (self.code, self.message)

    def line_error(self, req: JobRequest) -> LineError:
        """This error as the line's record in errors.jsonl."""
        return LineError(req.line, req.custom_id, self.code, f"line {req.line}: {self.message}")


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt before encoding: `text` to encode (with the tokenizer's own special tokens, or
    without them for a chat template's text, which holds them already), or `ids` ready."""

    text: str | None = None
    add_special_tokens: bool = True
    ids: list[int] | None = None
    failure: str = "the prompt cannot be tokenized"  # what an encoding error is reported as


def prompt_token_ids(
    req: JobRequest, tokenizer, max_model_len: int, reasoning_parser: str | None = None
) -> list[int]:
    """The prompt of `req` as token ids. Raises PromptError when it cannot run: the chat
    template fails, the prompt is empty or holds ids outside the vocabulary (invalid_prompt),
    or it leaves no room for one output token (context_length_exceeded).

    One line at a time: render_prompt, encode, checked_prompt_ids. A chunk of lines encodes
    its rendered prompts in one call instead (kvbatch.jobs.openai_format.prompt_batch), with the
    same ids."""
    rendered = render_prompt(req, tokenizer, reasoning_parser)
    ids = rendered.ids
    if ids is None:
        try:
            ids = tokenizer.encode(rendered.text, add_special_tokens=rendered.add_special_tokens)
        except Exception as exc:  # e.g. a lone surrogate from a JSON "\ud800" escape
            raise PromptError("invalid_prompt", f"{rendered.failure}: {exc}") from exc
    return checked_prompt_ids(ids, max_model_len)


def render_prompt(
    req: JobRequest, tokenizer, reasoning_parser: str | None = None
) -> RenderedPrompt:
    """What `req` asks the tokenizer to encode, or its ids when none is needed. Raises
    PromptError when the chat template fails or id prompts leave the vocabulary.

    `reasoning_parser`: the job's (kvbatch.engine.reasoning); a harmony model's (gpt-oss:
    openai_gptoss) messages are rendered by openai-harmony, with the line's reasoning_effort
    in the system message. Other chat templates get the line's chat_template_kwargs, and its
    reasoning_effort as a keyword when it gives one."""
    if req.messages is not None and reasoning_parser == HARMONY_PARSER:
        try:
            # read from the package when first needed: openai-harmony takes a second to import
            ids = engine.render_harmony_prompt(
                req.messages, tools=req.tools, reasoning_effort=req.reasoning_effort
            )
        except Exception as exc:  # HarmonyError, a tool openai-harmony cannot describe
            raise PromptError(
                "invalid_prompt", f"openai-harmony cannot render these messages: {exc}"
            ) from exc
        return RenderedPrompt(ids=ids)
    if req.messages is not None:
        _check_tool_support(req, tokenizer)
        failure = "the model's chat template rejects these messages"
        try:
            text = tokenizer.apply_chat_template(
                req.messages,
                tools=req.tools,
                add_generation_prompt=True,
                tokenize=False,
                **_template_kwargs(req),
            )
        except Exception as exc:  # jinja errors, no template, raise_exception() in a template
            raise PromptError("invalid_prompt", f"{failure}: {exc}") from exc
        return RenderedPrompt(text=text, add_special_tokens=False, failure=failure)
    if isinstance(req.prompt, str):
        return RenderedPrompt(text=req.prompt)
    if req.prompt is not None:
        ids = list(req.prompt)
        vocab = len(tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(
                "invalid_prompt",
                f"token id {bad} is outside the model's vocabulary [0, {vocab}): fix the prompt",
            )
        return RenderedPrompt(ids=ids)
    raise PromptError("invalid_prompt", "the request has neither messages nor a prompt")


def checked_prompt_ids(ids: list[int], max_model_len: int) -> list[int]:
    """`ids`, unless the prompt is empty or leaves no room for one output token."""
    if not ids:
        raise PromptError("invalid_prompt", "the prompt is empty: give at least one token")
    if len(ids) >= max_model_len:
        raise PromptError("context_length_exceeded", _prompt_too_long(len(ids), max_model_len))
    return ids


def _template_kwargs(req: JobRequest) -> dict:
    """The chat template's extra keywords: the line's chat_template_kwargs, and its
    reasoning_effort (as vLLM passes it) unless those name it themselves. The keywords the
    call itself sets cannot be overridden."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    for fixed in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation"):
        kwargs.pop(fixed, None)
    return kwargs


def _check_tool_support(req: JobRequest, tokenizer) -> None:
    """Refuse a line whose tools or tool messages the model's chat template would drop
    (judged from the template's source: one that never names them cannot show them)."""
    calls = any("tool_calls" in m for m in req.messages)
    results = any(m["role"] == "tool" for m in req.messages)
    wants_tools = req.tools is not None and req.tool_calling is not None  # "none": plain text
    if not (wants_tools or calls or results):
        return
    try:
        source = tokenizer.get_chat_template(tools=req.tools)
    except Exception:  # no template at all: apply_chat_template says so below
        return
    if wants_tools and "tools" not in source:
        missing = "the line's 'tools'"
    elif calls and "tool_calls" not in source:
        missing = "the assistant messages' 'tool_calls'"
    elif results and '"tool"' not in source and "'tool'" not in source:
        missing = "the 'tool' messages (the results of calls)"
    else:
        _check_parser_markers(req, tokenizer)
        return
    raise PromptError(
        "invalid_prompt",
        f"the model's chat template ignores {missing}, so the model would never see them: "
        "run a model whose chat template supports tools (Qwen2.5, Qwen3, Llama 3.1, Hermes), "
        "or remove them",
    )


def _check_parser_markers(req: JobRequest, tokenizer) -> None:
    """Refuse tool_choice "auto" when the answer's text could not show the parser its calls:
    the engine's text skips special tokens, and some tokenizers mark `<tool_call>` special."""
    calling = req.tool_calling
    if calling is None or calling.mode != "auto":
        return
    hidden = _hidden_markers(tokenizer, calling.parser)
    if hidden:
        raise PromptError(
            "invalid_prompt",
            f"this model's tokenizer marks {', '.join(hidden)} as special tokens, which "
            f"answers leave out, so the {calling.parser} tool-call parser could never see a "
            "call: use tool_choice 'required' or a named function (constrained decoding "
            "needs no parser)",
        )


@functools.lru_cache(maxsize=8)
def _hidden_markers(tokenizer, parser: str) -> tuple[str, ...]:
    """The parser's markers that vanish when the engine decodes them (cached per tokenizer:
    checked for every line with tools)."""
    hidden = []
    for marker in get_parser(parser).markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if marker not in tokenizer.decode(ids, skip_special_tokens=True):
            hidden.append(marker)
    return tuple(hidden)


def embedding_token_ids(req: JobRequest, tokenizer, max_model_len: int) -> list[list[int]]:
    """Each input of an embeddings line as token ids (text is encoded as the engine encodes
    it, with the special tokens the tokenizer adds, e.g. Qwen3-Embedding's closing EOS; ids
    are taken as given). Raises PromptError for an input that cannot run: an id outside the
    vocabulary or an empty input (invalid_prompt), more than max_model_len tokens
    (context_length_exceeded: an embedding generates nothing, so the whole context is its)."""
    out = []
    vocab = len(tokenizer)
    for i, item in enumerate(req.inputs or ()):
        if isinstance(item, str):
            try:
                ids = tokenizer.encode(item)
            except Exception as exc:  # e.g. a lone surrogate from a JSON "\ud800" escape
                raise PromptError(
                    "invalid_prompt", f"input {i} cannot be tokenized: {exc}"
                ) from exc
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise PromptError(
                    "invalid_prompt",
                    f"input {i}: token id {bad} is outside the model's vocabulary [0, {vocab}): "
                    "fix the input",
                )
        if not ids:
            raise PromptError("invalid_prompt", f"input {i} is empty: give at least one token")
        if len(ids) > max_model_len:
            raise PromptError(
                "context_length_exceeded",
                f"input {i} has {len(ids)} tokens but the model takes at most {max_model_len} "
                f"(--max-model-len): shorten it",
            )
        out.append(ids)
    if not out:
        raise PromptError("invalid_prompt", "the request has no input")
    return out


def max_tokens_for(req: JobRequest, prompt_len: int, max_model_len: int) -> int:
    """The output cap to run `req` with, given its prompt length.

    A cap the line set itself must fit in the context, as with OpenAI and vLLM (PromptError
    context_length_exceeded otherwise); a default cap (16 for completions, the job's default
    for chat, or none) is clamped to the room left.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise PromptError("context_length_exceeded", _prompt_too_long(prompt_len, max_model_len))
    if req.max_tokens is None:
        return min(req.params.max_tokens, room)
    if req.max_tokens > room:
        raise PromptError(
            "context_length_exceeded",
            f"the prompt has {prompt_len} tokens and max_tokens asks for {req.max_tokens} more, "
            f"but the model takes {max_model_len} in all (--max-model-len): lower max_tokens to "
            f"{room} or less, or shorten the prompt",
        )
    return req.max_tokens


def sampling_params_for(req: JobRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """`req.params` with the output cap of `max_tokens_for`: what to hand the engine."""
    return dataclasses.replace(
        req.params, max_tokens=max_tokens_for(req, prompt_len, max_model_len)
    )


def _prompt_too_long(prompt_len: int, max_model_len: int) -> str:
    return (
        f"the prompt has {prompt_len} tokens but the model takes at most {max_model_len - 1} "
        f"(--max-model-len {max_model_len}, including one output token): shorten the prompt"
    )
