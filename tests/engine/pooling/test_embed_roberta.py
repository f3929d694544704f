"""LLM.embed on RoBERTa encoders (XLMRobertaModel as bge-m3 and multilingual-e5 are saved,
RobertaModel as all-distilroberta-v1) against sentence-transformers on the same tiny random
folders, up to the position limit and one token past it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine import LLM
from kvbatch.engine.encoder.engine import EncoderEngine
from tests.engine.pooling.st_checkpoints import (
    ROBERTA_POSITIONS,
    build_roberta_checkpoint,
    ids_to_text,
    st_embeddings,
)

MIN_COSINE = 0.9999
LIMIT = ROBERTA_POSITIONS - 2  # positions after pad_token_id 1

CHECKPOINTS = {  # as the real ones pool: bge-m3 by CLS, e5 and all-distilroberta by mean
    "xlmr-cls": ("XLMRobertaModel", "cls"),
    "xlmr-mean": ("XLMRobertaModel", "mean"),
    "roberta-mean": ("RobertaModel", "mean"),
}


@pytest.fixture(scope="module")
def robertas(tmp_path_factory):
    root = tmp_path_factory.mktemp("roberta_embedders")
    return {
        name: build_roberta_checkpoint(root / name, architecture, mode=mode)
        for name, (architecture, mode) in CHECKPOINTS.items()
    }


def random_ids(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)  # from 3: no <s>, <pad>, </s> inside an input
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_matches_sentence_transformers_up_to_the_position_limit(robertas, name):
    """Inputs of 1 to LIMIT tokens (every position used) in batches of similar lengths."""
    texts = [ids_to_text(p) for p in random_ids((1, 5, 40, 3, LIMIT, 12, 5), seed=1)]
    llm = LLM(model=str(robertas[name]), device="cpu", max_num_batched_tokens=80)
    assert isinstance(llm.engine, EncoderEngine) and llm.engine.max_model_len == LIMIT
    got = torch.tensor(llm.embed(texts))
    want = st_embeddings(robertas[name], texts)
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine.tolist()
    assert llm.stats().num_steps > 1


def test_an_input_past_the_position_limit_is_refused(robertas):
    """LIMIT + 1 tokens would need position row ROBERTA_POSITIONS, which the table lacks: the
    input is refused, and max_model_len cannot be raised past the positions."""
    path = robertas["xlmr-cls"]
    (too_long,) = random_ids((LIMIT + 1,), seed=2)
    llm = LLM(model=str(path), device="cpu")
    with pytest.raises(
        ValueError, match=f"the input has {LIMIT + 1} tokens .* max_model_len={LIMIT}"
    ):
        llm.embed(too_long)
    assert llm.stats().num_steps == 0
    with pytest.raises(ValueError, match=f"max_model_len={LIMIT + 1} exceeds the model's {LIMIT}"):
        LLM(model=str(path), device="cpu", max_model_len=LIMIT + 1)
