"""Reading the pooling from sentence-transformers' files, both formats, and refusing what the
engine cannot reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.engine.pooling.config import (
    DECODER_DEFAULT,
    PoolingConfig,
    PoolingMethod,
    read_pooling_config,
)

ST6 = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
ST6_TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
ST6_NORMALIZE = "sentence_transformers.base.modules.normalize.Normalize"


def write_modules(folder: Path, pooling: dict | None, normalize: bool = True, extra=()) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST6_TRANSFORMER}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST6})
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST6_NORMALIZE})
    modules.extend(extra)
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_no_sentence_transformers_files_means_last_token_normalised(tmp_path):
    assert read_pooling_config(tmp_path) == DECODER_DEFAULT
    assert DECODER_DEFAULT == PoolingConfig(PoolingMethod.LAST, normalize=True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert read_pooling_config(gguf) == DECODER_DEFAULT  # a file: its folder is read


@pytest.mark.parametrize(
    "mode, method",
    [("lasttoken", PoolingMethod.LAST), ("mean", PoolingMethod.MEAN), ("cls", PoolingMethod.CLS)],
)
def test_version_6_pooling_mode(tmp_path, mode, method):
    write_modules(tmp_path, {"embedding_dimension": 64, "pooling_mode": mode})
    assert read_pooling_config(tmp_path) == PoolingConfig(method, normalize=True)


@pytest.mark.parametrize(
    "flag, method",
    [
        ("pooling_mode_lasttoken", PoolingMethod.LAST),
        ("pooling_mode_mean_tokens", PoolingMethod.MEAN),
        ("pooling_mode_cls_token", PoolingMethod.CLS),
    ],
)
def test_legacy_flags_and_legacy_type_names(tmp_path, flag, method):
    config = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False, flag: True}
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    # no Normalize module: the vectors are not normalised
    assert read_pooling_config(tmp_path) == PoolingConfig(method, normalize=False)


def test_needs_every_token():
    assert not PoolingConfig(PoolingMethod.LAST).needs_every_token
    assert PoolingConfig(PoolingMethod.MEAN).needs_every_token
    assert PoolingConfig(PoolingMethod.CLS).needs_every_token


@pytest.mark.parametrize(
    "pooling, extra, message",
    [
        ({"pooling_mode": "max"}, (), "'max' is not supported"),
        ({"pooling_mode": ["cls", "mean"]}, (), "concatenated"),
        ({"pooling_mode_max_tokens": True}, (), "'max' is not supported"),
        ({"pooling_mode": "mean", "include_prompt": False}, (), "include_prompt"),
        (None, (), "no Pooling module"),
        (
            {"pooling_mode": "mean"},
            [{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}],
            "3_Dense",
        ),
    ],
)
def test_what_the_engine_cannot_reproduce_is_refused_by_name(tmp_path, pooling, extra, message):
    write_modules(tmp_path, pooling, extra=extra)
    with pytest.raises(ValueError, match=message):
        read_pooling_config(tmp_path)


def test_a_broken_modules_file_says_so(tmp_path):
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_pooling_config(tmp_path)
