"""`/v1/embeddings` bodies against the openai package's own types and its base64 decoding."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from openai.types import CreateEmbeddingResponse

from kvbatch.engine import EmbeddingOutput
from kvbatch.jobs.openai_format.embedding_body import embedding_body, embedding_response


def outputs(n: int = 3, dim: int = 48, seed: int = 0) -> list[EmbeddingOutput]:
    g = torch.Generator().manual_seed(seed)
    vectors = F.normalize(torch.randn(n, dim, generator=g), dim=-1)
    return [EmbeddingOutput(str(i), None, list(range(i + 2)), vectors[i]) for i in range(n)]


def test_float_body_validates_as_create_embedding_response():
    outs = outputs()
    body = embedding_response(outs, model="tiny-embed")
    parsed = CreateEmbeddingResponse.model_validate(body)
    assert parsed.model == "tiny-embed" and parsed.object == "list"
    assert parsed.usage.prompt_tokens == parsed.usage.total_tokens == 2 + 3 + 4
    assert [d.index for d in parsed.data] == [0, 1, 2]
    for d, o in zip(parsed.data, outs):
        assert d.object == "embedding"
        assert torch.equal(torch.tensor(d.embedding, dtype=torch.float32), o.embedding)


def decode_as_the_openai_client_does(body: dict) -> CreateEmbeddingResponse:
    """The client asks for base64 by default and decodes it after construction."""
    from openai._types import NOT_GIVEN
    from openai.lib._parsing._embeddings import parse_embedding_response

    constructed = CreateEmbeddingResponse.construct(**body)
    return parse_embedding_response(constructed, encoding_format=NOT_GIVEN)


def test_base64_round_trip_is_exact():
    outs = outputs(n=4, dim=64, seed=1)
    body = embedding_response(outs, model="m", encoding_format="base64")
    for d, o in zip(body["data"], outs):
        assert isinstance(d["embedding"], str)
        raw = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert np.array_equal(raw, o.embedding.numpy())
    decoded = decode_as_the_openai_client_does(body)
    again = CreateEmbeddingResponse.model_validate(decoded.model_dump())
    for d, o in zip(again.data, outs):
        assert torch.equal(torch.tensor(d.embedding, dtype=torch.float32), o.embedding)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_dimensions_cut_and_renormalise(encoding_format):
    outs = outputs(n=2, dim=32, seed=2)
    body = embedding_response(outs, model="m", encoding_format=encoding_format, dimensions=8)
    if encoding_format == "base64":
        body = decode_as_the_openai_client_does(body).model_dump()
    parsed = CreateEmbeddingResponse.model_validate(body)
    for d, o in zip(parsed.data, outs):
        got = torch.tensor(d.embedding)
        assert got.shape == (8,)
        assert torch.allclose(got, F.normalize(o.embedding[:8], dim=-1), atol=1e-7)
    raw = embedding_body(
        torch.stack([o.embedding for o in outs]) * 3,
        model="m",
        prompt_tokens=5,
        dimensions=8,
        normalize=False,
    )
    assert torch.allclose(torch.tensor(raw["data"][0]["embedding"]), 3 * outs[0].embedding[:8])


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"encoding_format": "int8"}, "encoding_format 'int8' is not supported"),
        ({"dimensions": 49}, "ask for 1 to 48"),
        ({"dimensions": "8"}, "dimensions must be an integer"),
    ],
)
def test_bad_options_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        embedding_response(outputs(), model="m", **kw)


def test_no_outputs_is_an_error():
    with pytest.raises(ValueError, match="at least one output"):
        embedding_response([], model="m")
