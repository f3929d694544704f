"""Pydantic models of OpenAI Batch input lines and of the request bodies kvbatch answers.

A line is `{custom_id, method, url, body}`; the body is a Chat Completions request
(`/v1/chat/completions`, `messages`), a legacy Completions request (`/v1/completions`,
`prompt`) or an Embeddings request (`/v1/embeddings`, `input`: see EmbeddingBody). The models are strict (no "1.0" for a number, no `true` for an int) and reject
unknown fields, as OpenAI does. Each body field falls into one of four kinds:

- mapped to `SamplingParams`: max_tokens / max_completion_tokens, temperature, top_p, top_k,
  min_p, seed, stop, stop_token_ids, ignore_eos, logprobs / top_logprobs, n,
  presence_penalty, frequency_penalty, repetition_penalty (vLLM's), logit_bias, and chat's
  response_format (kvbatch.jobs.openai_format.response_format) and tools / tool_choice /
  parallel_tool_calls (kvbatch.jobs.openai_format.tools: the tools go to the chat template, a forced
  tool_choice constrains the output);
- passed to the prompt: chat's reasoning_effort (low / medium / high: gpt-oss's system
  message, another template's keyword) and chat_template_kwargs (vLLM's: the chat template's
  keywords), kvbatch.jobs.openai_format.prompts;
- unsupported, because it would change the answer: accepted only at its neutral value
  (best_of=1, stream=false, functions=[], ...; null always),
  otherwise an `unsupported_parameter` error (see `_UNSUPPORTED`);
- ignored, because it changes nothing we return: user, metadata, store, service_tier, ...;
- anything else: unknown.

`description=` on each field is the rule a user reads in an error message
("'temperature' must be <description>, got 'hot'").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvbatch.engine import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    EmbeddingPrompt,
    SamplingParams,
    StructuredOutputs,
    embedding_inputs,
)
from kvbatch.jobs.openai_format.response_format import PARAMETER_RULE, SHAPES, read_response_format
from kvbatch.jobs.openai_format.score_schemas import RerankBody, ScoreBody
from kvbatch.jobs.openai_format.tools import (
    CHOICES,
    ToolCalling,
    forced_name,
    read_tool_choice,
    read_tools,
    tool_calling_for,
    tool_constraint,
)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, SCORE_URL, RERANK_URL)
SCORING_URLS = (SCORE_URL, RERANK_URL)
"""Endpoints answered by scoring (query, document) pairs: vLLM's run-batch takes both, and
one job may mix them (the same engine path answers both)."""
GENERATION_URLS = (CHAT_URL, COMPLETIONS_URL)
"""Endpoints one job may mix: both generate text with the same engine. An embeddings job's
lines are all embeddings (as an OpenAI batch has one endpoint)."""
MAX_CUSTOM_ID_LEN = 512
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits (chat top_logprobs, completions logprobs)
MAX_COMPLETION_LOGPROBS = 5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy Completions API's default
CONTEXT_MAX_TOKENS = 2**31 - 1
"""`SamplingParams.max_tokens` of a request that may generate up to the end of the context
(chat without max_tokens and without a job default): the engine stops at max_model_len, and
`kvbatch.jobs.openai_format.prompts.max_tokens_for` turns it into the exact room left."""

_PENALTY_RULE = f"a number between -{MAX_PENALTY:g} and {MAX_PENALTY:g}"
_LOGIT_BIAS_RULE = 'an object of token id strings to numbers between -100 and 100 ({"50256": -100})'
_STRICT = ConfigDict(strict=True, extra="forbid")
_ROLES = ("system", "developer", "user", "assistant", "tool")


# --- the line ---------------------------------------------------------------------------------


class BatchLine(BaseModel):
    """One input line. `body` is checked afterwards against the model its `url` names."""

    model_config = _STRICT

    custom_id: str = Field(
        min_length=1,
        max_length=MAX_CUSTOM_ID_LEN,
        description=f"a non-empty string of at most {MAX_CUSTOM_ID_LEN} characters, unique in the file",
    )
    method: Literal["POST"] = Field(description='"POST"')
    url: Literal[
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank"
    ] = Field(
        description=f'"{CHAT_URL}", "{COMPLETIONS_URL}", "{EMBEDDINGS_URL}", "{SCORE_URL}" '
        f'or "{RERANK_URL}"'
    )
    body: dict[str, Any] = Field(description="an object (the request body)")


# --- messages ---------------------------------------------------------------------------------


def _role(value: object) -> str:
    if value not in _ROLES:
        why = (
            " (the 'function' role is OpenAI's deprecated form: send the result as a 'tool' "
            "message with its tool_call_id)"
            if value == "function"
            else ""
        )
        raise PydanticCustomError("invalid_messages", _ROLE_RULE + why)
    return "system" if value == "developer" else value  # OpenAI's newer name for system


_ROLE_RULE = "must be one of " + ", ".join(map(repr, _ROLES))
_PARTS = "must be a string or a list of text parts (objects with type 'text' and a string 'text')"


def _content(value: object) -> object:
    """A string, or a list of text parts joined with newlines (as vLLM does)."""
    if not isinstance(value, list):
        return value  # the str validator reports anything else
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            why = f"content parts of type {kind!r} are not supported" if kind else "a bad part"
            raise PydanticCustomError("invalid_messages", _PARTS + f" ({why})")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise PydanticCustomError(
                "invalid_messages", _PARTS + " (a text part holds a string 'text' and nothing else)"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _arguments(value: object) -> object:
    """A call's `arguments` as the chat template takes them: OpenAI sends a JSON text, and
    templates (Qwen's, Llama 3.1's) write `arguments | tojson`, which would quote that text
    once more; vLLM parses it into an object first, and so does kvbatch."""
    if not isinstance(value, str):
        raise PydanticCustomError("invalid_messages", "must be a JSON text (a string)")
    try:
        return json.loads(value)
    except ValueError:
        raise PydanticCustomError(
            "invalid_messages", "must be valid JSON (the arguments the call was made with)"
        ) from None


class _CalledFunction(BaseModel):
    model_config = _STRICT

    name: str
    arguments: Annotated[Any, BeforeValidator(_arguments)]


class _ToolCall(BaseModel):
    """A call an earlier assistant turn made: {id, type: "function", function}."""

    model_config = _STRICT

    id: str
    type: Literal["function"]
    function: _CalledFunction


class ChatMessage(BaseModel):
    """A message of the conversation. `developer` becomes `system`; text parts are joined.
    An assistant message may carry the `tool_calls` it made (then `content` may be null), and
    a `tool` message answers one of them by `tool_call_id`."""

    model_config = _STRICT

    role: Annotated[str, BeforeValidator(_role)]
    content: Annotated[str | None, BeforeValidator(_content)] = None
    name: str | None = None
    tool_calls: Annotated[list[_ToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError(
                "invalid_messages", "only an assistant message carries 'tool_calls'"
            )
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise PydanticCustomError(
                "invalid_messages",
                "a 'tool' message needs the 'tool_call_id' of the call it answers (and only a "
                "tool message has one)",
            )
        if self.content is None and self.tool_calls is None:
            raise PydanticCustomError(
                "invalid_messages",
                "needs 'content' (a string or text parts): only an assistant message with "
                "tool_calls may leave it out",
            )
        return self

    def as_dict(self) -> dict[str, Any]:
        """The form `tokenizer.apply_chat_template` takes (a call's arguments as an object,
        a missing content as "": templates add strings to it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# --- unsupported parameters -------------------------------------------------------------------

# name -> (is the value neutral?, what to do instead). None is always neutral.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (
        lambda v: v == 1,
        "kvbatch returns every sampled choice: use 'n' instead of best_of, or remove it",
    ),
    "stream": (lambda v: v is False, "batch output cannot stream: remove it or set false"),
    "stream_options": (lambda v: False, "batch output cannot stream: remove it"),
    "echo": (lambda v: v is False, "echoing the prompt is not implemented: remove it"),
    "suffix": (lambda v: v == "", "insertion (suffix) is not implemented: remove it"),
    "functions": (
        lambda v: v == [],
        "'functions' is OpenAI's deprecated form of tool calling: send them as 'tools'",
    ),
    "function_call": (
        lambda v: v == "none",
        "'function_call' is OpenAI's deprecated form: use 'tool_choice'",
    ),
    "modalities": (lambda v: v == ["text"], "only text output is supported: remove it"),
    "audio": (lambda v: False, "only text output is supported: remove it"),
    "prediction": (lambda v: False, "predicted outputs are not implemented: remove it"),
    "web_search_options": (lambda v: False, "web search is not available: remove it"),
    "verbosity": (lambda v: False, "verbosity control is not implemented: remove it"),
}


def _check_supported(value: Any, name: str) -> Any:
    neutral, hint = _UNSUPPORTED[name]
    if value is not None and not neutral(value):
        raise PydanticCustomError("unsupported_parameter", hint)
    return value


# --- bodies -----------------------------------------------------------------------------------

_NonEmptyStr = Annotated[str, Field(min_length=1)]
_TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

    model: str | None = Field(None, description="a string (the model's name)")
    max_tokens: int | None = Field(None, ge=1, description="an integer >= 1")
    temperature: float | None = Field(None, ge=0, le=2, description="a number between 0 and 2")
    top_p: float | None = Field(None, ge=0, le=1, description="a number between 0 and 1")
    top_k: int | None = Field(None, ge=-1, description="an integer: -1 or 0 (off) or >= 1")
    min_p: float | None = Field(None, ge=0, le=1, description="a number between 0 and 1")
    seed: int | None = Field(None, ge=0, lt=2**63, description="an integer in [0, 2**63)")
    stop: _NonEmptyStr | list[_NonEmptyStr] | None = Field(
        None,
        description=f"a non-empty string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
    )
    stop_token_ids: list[_TokenId] | None = Field(None, description="a list of token ids (>= 0)")
    ignore_eos: bool | None = Field(None, description="true or false")

    n: int | None = Field(None, ge=1, le=MAX_N, description=f"an integer between 1 and {MAX_N}")
    presence_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY, description=_PENALTY_RULE
    )
    frequency_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY, description=_PENALTY_RULE
    )
    repetition_penalty: float | None = Field(  # vLLM's extra parameter
        None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description=f"a number between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} "
        "(1 = off; above 1 discourages repeats; the sampler's float32 bounds)",
    )
    logit_bias: dict[str, float] | None = Field(None, description=_LOGIT_BIAS_RULE)
    stream: bool | None = Field(None, description="false")
    stream_options: Any = None

    # Ignored: they change nothing kvbatch returns.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator(*_UNSUPPORTED, check_fields=False)
    @classmethod
    def _supported(cls, value: Any, info) -> Any:
        return _check_supported(value, info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdecimal() or not key.isascii():
                raise PydanticCustomError(
                    PARAMETER_RULE,
                    "'logit_bias' keys must be token ids written as strings (\"50256\"), got {key}",
                    {"key": repr(key)},
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise PydanticCustomError(
                    PARAMETER_RULE,
                    "'logit_bias' values must be numbers between -100 and 100, got {bias} for {key}",
                    {"bias": bias, "key": repr(key)},
                )
        return value or None  # {} = none

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError("invalid_parameter", "too many stop sequences")
        return value or None  # [] = none

    # -- mapping to the engine -----------------------------------------------------------------

    def requested_max_tokens(self) -> int | None:
        """The output cap the line sets itself, or None."""
        return self.max_tokens

    def default_max_tokens(self, job_default: int | None) -> int:
        """The output cap when the line sets none (`job_default`: the job's, for chat)."""
        raise NotImplementedError

    def logprobs_n(self) -> int | None:
        """How many alternatives per position to report (None = no logprobs at all)."""
        raise NotImplementedError

    def structured_outputs(self) -> StructuredOutputs | None:
        """The output constraint the body asks for (chat's response_format), or None."""
        return None

    def sampling_params(self, job_default_max_tokens: int | None = None) -> SamplingParams:
        """The engine's options for this body. Raises ValueError (SamplingParams') on a
        combination the field checks let through."""
        top_p, top_k = self.top_p, self.top_k
        if top_p == 0:  # the nucleus shrinks to the most likely token
            top_p, top_k = 1.0, 1
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=max_tokens or self.default_max_tokens(job_default_max_tokens),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.logprobs_n(),
            n=self.n or 1,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            structured_outputs=self.structured_outputs(),
        )


class ChatCompletionBody(_Body):
    """The body of a `/v1/chat/completions` line."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="a non-empty list of {role, content} objects"
    )
    max_completion_tokens: int | None = Field(None, ge=1, description="an integer >= 1")
    logprobs: bool | None = Field(None, description="true or false")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_CHAT_TOP_LOGPROBS,
        description=f"an integer between 0 and {MAX_CHAT_TOP_LOGPROBS}",
    )

    tools: Annotated[Any, Field(description="a list of function tools")] = None
    tool_choice: Annotated[Any, Field(description=CHOICES)] = None
    parallel_tool_calls: bool | None = Field(None, description="true or false")
    functions: Any = None
    function_call: Any = None
    response_format: Annotated[Any, Field(description=SHAPES)] = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="'low', 'medium' or 'high' (how long a reasoning model thinks: gpt-oss's "
        "system message says it; other chat templates read it as a keyword)",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(  # vLLM's extra parameter
        None,
        description='an object of keywords for the chat template ({"enable_thinking": false})',
    )
    _tool_constraint: StructuredOutputs | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionBody:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise PydanticCustomError(
                    "invalid_parameter",
                    "'max_tokens' and 'max_completion_tokens' disagree: set only one of them",
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError(
                "invalid_parameter",
                "'top_logprobs' needs 'logprobs': true: set it or drop top_logprobs",
            )
        self._check_tool_choice()
        return self

    def _check_tool_choice(self) -> None:
        choice, names = self.tool_choice, [t["function"]["name"] for t in self.tools or ()]
        if choice not in (None, "none") and not names:
            raise PydanticCustomError(
                "invalid_parameter",
                f"'tool_choice' {choice.replace('function:', 'function ')!r} needs 'tools': "
                "give the functions, or remove tool_choice",
            )
        forced = forced_name(choice)
        if forced is not None and forced not in names:
            raise PydanticCustomError(
                "invalid_parameter",
                f"'tool_choice' names the function {forced!r}, which is not in 'tools' "
                f"({', '.join(map(repr, names))}): name one of them",
            )
        if self.response_format is not None and (forced or choice == "required"):
            raise PydanticCustomError(
                "invalid_parameter",
                "'response_format' and a forced 'tool_choice' both constrain the output: the "
                "answer is the tool's arguments; drop response_format or set tool_choice to "
                "'auto' or 'none'",
            )
        if self.tools and (forced is not None or choice == "required"):
            # built now: a conflict between the tools' $defs is this line's error
            self._tool_constraint = tool_constraint(self.tools, choice, self.parallel_tool_calls)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: Any) -> list[dict] | None:
        return read_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | None:
        return read_tool_choice(value)

    def tool_calling(self, parser: str | None) -> ToolCalling | None:
        """How to read the answer for tool calls (None: plain text), with the job's tool-call
        parser. Raises ValueError when tool_choice "auto" has no parser to read calls."""
        return tool_calling_for(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> StructuredOutputs | None:
        return read_response_format(value)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def structured_outputs(self) -> StructuredOutputs | None:
        return self._tool_constraint or self.response_format

    def default_max_tokens(self, job_default: int | None) -> int:
        return job_default or CONTEXT_MAX_TOKENS

    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]


def _one_prompt(value: object) -> object:
    """A string or a list of token ids; a list holding one of those is that one prompt."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise PydanticCustomError(
                "unsupported_parameter",
                "it holds {count} prompts and kvbatch answers one prompt per line: put each "
                "prompt on its own line under its own custom_id",
                {"count": len(value)},
            )
        return value[0]
    return value


class CompletionBody(_Body):
    """The body of a `/v1/completions` line."""

    prompt: Annotated[
        _NonEmptyStr | Annotated[list[_TokenId], Field(min_length=1)], BeforeValidator(_one_prompt)
    ] = Field(description="a non-empty string or a non-empty list of token ids")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description=f"an integer between 0 and {MAX_COMPLETION_LOGPROBS}",
    )
    echo: bool | None = Field(None, description="false")
    suffix: str | None = Field(None, description="an empty string")
    best_of: int | None = Field(None, ge=1, description="1")

    def default_max_tokens(self, job_default: int | None) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    def logprobs_n(self) -> int | None:
        return self.logprobs


def _embedding_input(value: object) -> list[EmbeddingPrompt]:
    try:
        return embedding_inputs(value)
    except ValueError as e:
        raise PydanticCustomError(PARAMETER_RULE, "'input': {why}", {"why": str(e)}) from None


class EmbeddingBody(BaseModel):
    """The body of a `/v1/embeddings` line: each input is one vector of the answer."""

    model_config = _STRICT

    model: str | None = Field(None, description="a string (the model's name)")
    input: Annotated[list[EmbeddingPrompt], BeforeValidator(_embedding_input)] = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists"
    )
    dimensions: int | None = Field(None, ge=1, description="an integer >= 1")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description='"float" or "base64"'
    )
    user: Any = None  # ignored


BODIES: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatCompletionBody,
    COMPLETIONS_URL: CompletionBody,
    EMBEDDINGS_URL: EmbeddingBody,
    SCORE_URL: ScoreBody,
    RERANK_URL: RerankBody,
}
"""The body model of each url."""
