"""engine/model/bert.py on RoBERTa checkpoints (XLMRobertaModel: bge-m3, multilingual-e5;
RobertaModel: all-distilroberta) against transformers' own models on tiny random checkpoints:
the same last hidden states for a padded batch, positions numbered after the pad id, the
input limit that numbering leaves, and loud refusals of what the forward does not run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine.model.bert import BertConfig
from kvbatch.engine.model.loader import is_encoder_checkpoint, load_encoder
from kvbatch.jobs.model_info import max_model_len
from tests.engine.pooling.st_checkpoints import ROBERTA_POSITIONS, build_roberta_checkpoint

CPU = torch.device("cpu")
ARCHITECTURES = ("XLMRobertaModel", "RobertaModel")
LIMIT = ROBERTA_POSITIONS - 2  # pad_token_id 1: positions 2 .. 65


def padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, longest] ids padded with `pad`, and transformers' attention mask for them."""
    ids = torch.full((len(prompts), max(map(len, prompts))), pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, : len(p)], mask[row, : len(p)] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hidden_states_match_transformers_on_a_padded_batch(tmp_path, architecture):
    """One padded batch, inputs of 1 to LIMIT tokens (the last fills every position); one
    input holds the pad id itself, which transformers numbers as padding (position 1) while
    its attention mask still lets it be seen."""
    from transformers import AutoModel

    path = build_roberta_checkpoint(tmp_path / "m", architecture, mode=None)
    assert is_encoder_checkpoint(path)
    loaded = load_encoder(path, torch.float32, CPU)
    assert loaded.config.max_input_length == LIMIT and loaded.config.position_padding_idx == 1
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 7, 30, LIMIT)]
    prompts[2][5] = prompts[2][9] = 1  # the pad id inside an input
    ids, mask = padded(prompts, pad=1)
    reference = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    assert type(reference).__name__ == architecture
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        got = loaded.model(ids, mask.sum(dim=1))
        got_zero_padded = loaded.model(ids * mask, mask.sum(dim=1))  # the engine pads with 0
    for row, p in enumerate(prompts):
        torch.testing.assert_close(got[row, : len(p)], want[row, : len(p)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_zero_padded[row, : len(p)], got[row, : len(p)])


def test_positions_skip_the_pad_id_as_transformers_numbers_them(tmp_path):
    from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaEmbeddings

    loaded = load_encoder(build_roberta_checkpoint(tmp_path / "m", mode=None), torch.float32, CPU)
    ids = torch.tensor([[0, 5, 1, 7, 2, 9], [0, 8, 2, 4, 4, 4]])
    lengths = torch.tensor([6, 3])
    real = torch.arange(6)[None, :] < lengths[:, None]
    got = loaded.model._positions(ids, real, torch.arange(6))
    want = XLMRobertaEmbeddings.create_position_ids_from_input_ids(ids, padding_idx=1)
    assert got[0].tolist() == want[0].tolist() == [2, 3, 1, 4, 5, 6]
    assert got[1, :3].tolist() == want[1, :3].tolist() == [2, 3, 4]


def hf_config(**change) -> dict:
    hf = {
        "architectures": ["XLMRobertaModel"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "max_position_embeddings": 514,
        "pad_token_id": 1,
        **change,
    }
    return {k: v for k, v in hf.items() if v != "absent"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"position_embedding_type": "relative_key_query"}, "position_embedding_type="),
        ({"is_decoder": True}, "is_decoder=True"),
        ({"add_cross_attention": True}, "add_cross_attention=True"),
        ({"pad_token_id": None}, "pad_token_id=None: RoBERTa's positions start after"),
        ({"max_position_embeddings": 2}, "leaves no position for an input"),
        ({"architectures": ["XLMRobertaForMaskedLM"]}, "XLMRobertaForMaskedLM is not an encoder"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        BertConfig.from_hf(hf_config(**change))


@pytest.mark.parametrize(
    "change, limit",
    [({}, 512), ({"pad_token_id": "absent"}, 512), ({"max_position_embeddings": 8194}, 8192)],
)
def test_input_limit_is_the_positions_after_the_pad_id(change, limit):
    """xlm-roberta-base / multilingual-e5: 514 rows, 512 tokens; bge-m3: 8194, 8192;
    transformers' default pad id (1) when config.json has none."""
    assert BertConfig.from_hf(hf_config(**change)).max_input_length == limit
    bert = BertConfig.from_hf(hf_config(architectures=["BertModel"], **change))
    assert bert.max_input_length == bert.max_position_embeddings  # BERT counts from 0


def test_submit_uses_the_same_input_limit(tmp_path):
    """kvbatch submit refuses what the engine would: max_model_len caps at 64, not 66."""
    path = build_roberta_checkpoint(tmp_path / "m", "RobertaModel", mode=None)
    assert max_model_len(str(path)) == LIMIT
    assert max_model_len(str(path), override=LIMIT) == LIMIT
    with pytest.raises(ValueError, match=f"must be in \\[1, {LIMIT}\\]"):
        max_model_len(str(path), override=LIMIT + 1)


def test_weights_under_the_task_models_prefix_load(tmp_path):
    """A base model saved from inside XLMRobertaForMaskedLM names its tensors `roberta.*`:
    they load as transformers loads them; the masked-LM head is refused by name."""
    path = build_roberta_checkpoint(tmp_path / "m", mode=None)
    plain = load_encoder(path, torch.float32, CPU).model.state_dict()
    weights = load_file(path / "model.safetensors")
    prefixed = {f"roberta.{k}": v for k, v in weights.items()}
    save_file(prefixed, path / "model.safetensors")
    loaded = load_encoder(path, torch.float32, CPU).model.state_dict()
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)
    save_file({**prefixed, "lm_head.dense.weight": torch.zeros(64, 64)}, path / "model.safetensors")
    with pytest.raises(ValueError, match="has unknown 1 tensors .*lm_head.dense.weight"):
        load_encoder(path, torch.float32, CPU)
