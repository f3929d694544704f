"""The bodies of `/v1/score` and `/v1/rerank` lines, as vLLM's ScoreRequest and
RerankRequest take them.

Two of vLLM's values mean "no limit" and are taken as such, so a body written for vLLM runs
unchanged: `top_n: 0` (vLLM's default: every document, best first) and
`truncate_prompt_tokens: -1` (cut at the model's maximum length).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, extra="forbid")
_NonEmptyStr = Annotated[str, Field(min_length=1)]
_ScoreText = _NonEmptyStr | Annotated[list[_NonEmptyStr], Field(min_length=1)]
MODEL_MAX = -1
"""truncate_prompt_tokens' value for the model's maximum length (vLLM's)."""
_TRUNCATE_RULE = "an integer >= 1, or -1 for the model's maximum length"


def _truncate(value: int | None) -> int | None:
    if value is not None and value != MODEL_MAX and value < 1:
        raise ValueError(_TRUNCATE_RULE)
    return value


_Truncate = Annotated[int | None, AfterValidator(_truncate)]


class ScoreBody(BaseModel):
    """The body of a `/v1/score` line (vLLM's ScoreRequest): text_1 against text_2, one text
    against many (either side) or two lists of the same length item by item."""

    model_config = _STRICT

    model: str | None = Field(None, description="a string (the model's name)")
    text_1: _ScoreText = Field(description="a non-empty string or a non-empty list of them")
    text_2: _ScoreText = Field(description="a non-empty string or a non-empty list of them")
    truncate_prompt_tokens: _Truncate = Field(None, description=_TRUNCATE_RULE)
    user: Any = None  # ignored


class RerankBody(BaseModel):
    """The body of a `/v1/rerank` line (vLLM's RerankRequest): documents ranked by their
    relevance to the query, the `top_n` best kept (all when it is 0 or absent)."""

    model_config = _STRICT

    model: str | None = Field(None, description="a string (the model's name)")
    query: _NonEmptyStr = Field(description="a non-empty string")
    documents: Annotated[list[_NonEmptyStr], Field(min_length=1)] = Field(
        description="a non-empty list of non-empty strings"
    )
    top_n: int | None = Field(
        None, ge=0, description="an integer >= 0 (0 or absent: every document)"
    )
    truncate_prompt_tokens: _Truncate = Field(None, description=_TRUNCATE_RULE)
    user: Any = None  # ignored
