"""engine/model/bert.py against transformers' BertModel on tiny random checkpoints: the same
last hidden states for a padded batch of inputs of different lengths, and loud refusals of
what the forward does not run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine.model.bert import BertConfig
from kvbatch.engine.model.loader import is_encoder_checkpoint, load_encoder
from tests.engine.pooling.st_checkpoints import build_bert_checkpoint

CPU = torch.device("cpu")


def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last_hidden_state of each prompt, run alone (no padding at all)."""
    from transformers import BertModel

    model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.mark.parametrize("overrides", [{}, {"num_attention_heads": 2, "layer_norm_eps": 1e-5}])
def test_hidden_states_match_transformers(tmp_path, overrides):
    path = build_bert_checkpoint(tmp_path / "m", mode=None, **overrides)
    assert is_encoder_checkpoint(path)
    loaded = load_encoder(path, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 7, 40, 128)]
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), 511)  # padding ids the mask must hide
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
    with torch.no_grad():
        got = loaded.model(ids, torch.tensor([len(p) for p in prompts]))
    for row, want in enumerate(hf_hidden(path, prompts)):
        torch.testing.assert_close(got[row, : len(want)], want, atol=1e-5, rtol=1e-5)
    assert loaded.tokenizer is not None and not loaded.config.has_lm_head


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"is_decoder": True}, "is_decoder=True"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"architectures": ["BertForMaskedLM"]}, "BertForMaskedLM is not an encoder"),
        ({"intermediate_size": None}, "config.json lacks intermediate_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    hf = {
        "architectures": ["BertModel"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        **change,
    }
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        BertConfig.from_hf(hf)


def test_weights_config_json_does_not_describe_fail_the_load(tmp_path):
    path = build_bert_checkpoint(tmp_path / "m", mode=None)
    weights = load_file(path / "model.safetensors")
    extra = {**weights, "encoder.layer.2.output.dense.bias": torch.zeros(64)}
    save_file(extra, path / "model.safetensors")
    with pytest.raises(ValueError, match="has unknown 1 tensors .*encoder.layer.2"):
        load_encoder(path, torch.float32, CPU)
    del weights["encoder.layer.1.output.dense.bias"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="is missing 1 tensors .*layer.1.output.dense.bias"):
        load_encoder(path, torch.float32, CPU)
    weights["encoder.layer.1.output.dense.bias"] = torch.zeros(32)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"output.dense.bias has shape \(32,\) but .* \(64,\)"):
        load_encoder(path, torch.float32, CPU)


def test_decoder_folders_are_not_encoders(tiny_models, tmp_path):
    assert not is_encoder_checkpoint(tiny_models("qwen2"))
    assert not is_encoder_checkpoint(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert not is_encoder_checkpoint(tmp_path / "config.json")  # a file, not a folder
