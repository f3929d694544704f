"""Every kind of broken checkpoint is one line naming the file and the problem, from LLM(),
`kvbatch run`, `kvbatch worker` and `kvbatch generate`: never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbatch.cli import main
from kvbatch.engine import LLM
from kvbatch.engine.model.checkpoint_errors import CheckpointError
from tests.engine.model.broken_checkpoints import BREAKAGES
from tests.tiny_models import build_tiny_checkpoint


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint, with a small word-level tokenizer of its own."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("valid") / "model")
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    return path


def broken(valid: Path, tmp_path: Path, kind: str) -> tuple[Path, str, str]:
    folder = tmp_path / kind
    shutil.copytree(valid, folder)
    file, word = BREAKAGES[kind](folder)
    return folder, file, word


def test_the_valid_checkpoint_loads(valid: Path) -> None:
    llm = LLM(model=str(valid), num_kv_blocks=8, max_model_len=64)
    assert llm.tokenizer is not None


def one_line(text: str, file: str, word: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text and file in lines[0] and word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
def test_llm_names_the_file_and_the_problem(valid, tmp_path, kind) -> None:
    folder, file, word = broken(valid, tmp_path, kind)
    with pytest.raises(CheckpointError) as info:
        LLM(model=str(folder), num_kv_blocks=8, max_model_len=64)
    one_line(str(info.value), file, word)


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
@pytest.mark.parametrize("command", ["run", "worker", "generate"])
def test_commands_print_one_line(valid, tmp_path, capsys, command, kind) -> None:
    folder, file, word = broken(valid, tmp_path, kind)
    model = ["--model", str(folder)]
    if command == "run":
        job = tmp_path / "job.jsonl"
        body = {"prompt": [5, 6], "max_tokens": 1}
        job.write_text(
            json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body})
            + "\n"
        )
        argv = ["run", str(job), "-o", str(tmp_path / "out.jsonl"), *model]
    elif command == "worker":
        argv = ["worker", *model, "--broker", "redis://127.0.0.1:1/0"]
    else:
        argv = ["generate", *model, "--prompt", "w5 w6", "--max-tokens", "1"]
    assert main(argv) != 0
    one_line(capsys.readouterr().err, file, word)
