"""LLM.embed on RoBERTa encoders (XLMRobertaModel as bge-m3 and multilingual-e5 are saved,
RobertaModel as all-distilroberta-v1) against sentence-transformers on the same tiny random
folders, up to the position limit and one token past it. Their tokenizer encloses each text
in <0> .. <2> (RoBERTa's <s> .. </s>) and pads with <1>, so a text of LIMIT - 2 words fills
every position."""

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
    """Inputs of 3 to LIMIT tokens (every position used) in batches of similar lengths."""
    texts = [ids_to_text(p) for p in random_ids((1, 5, 40, 3, LIMIT - 2, 12, 5), seed=1)]
    llm = LLM(model=str(robertas[name]), device="cpu", max_num_batched_tokens=80)
    assert isinstance(llm.engine, EncoderEngine) and llm.engine.max_model_len == LIMIT
    got = torch.tensor(llm.embed(texts))
    want = st_embeddings(robertas[name], texts)
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine.tolist()
    assert llm.stats().num_steps > 1
    assert llm.stats().prompt_tokens == sum(len(t.split()) + 2 for t in texts)  # <s> .. </s>
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert max(map(len, ids)) == LIMIT and {i[0] for i in ids} == {0}
    assert torch.allclose(torch.tensor(llm.embed(ids)), got, atol=1e-5)  # ids in


def test_an_input_past_the_position_limit_is_refused(robertas):
    """LIMIT + 1 tokens would need position row ROBERTA_POSITIONS, which the table lacks: the
    input is refused (as text, with its <s> and </s>, or as ids), and max_model_len cannot
    be raised past the positions."""
    path = robertas["xlmr-cls"]
    (words,) = random_ids((LIMIT - 1,), seed=2)
    llm = LLM(model=str(path), device="cpu")
    refused = f"the input has {LIMIT + 1} tokens .* max_model_len={LIMIT}"
    with pytest.raises(ValueError, match=refused):
        llm.embed(ids_to_text(words))
    with pytest.raises(ValueError, match=refused):
        llm.embed([0, *words, 2])
    assert llm.stats().num_steps == 0
    with pytest.raises(ValueError, match=f"max_model_len={LIMIT + 1} exceeds the model's {LIMIT}"):
        LLM(model=str(path), device="cpu", max_model_len=LIMIT + 1)
