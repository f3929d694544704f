"""`kvbatch run --model <gpt-oss folder>` end to end: a tiny random gpt-oss whose experts are
written in MXFP4 as OpenAI publishes them, with the gpt-oss tokenizer (o200k_harmony, built
offline: tests/harmony_tokenizer.py). The prompt is rendered by openai-harmony, the answer's
tokens are transformers' greedy ones (reading the same MXFP4 files with
Mxfp4Config(dequantize=True)), and the line's reasoning and content are what openai-harmony's
parser makes of those tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbatch.cli import main
from kvbatch.engine.reasoning.harmony import HarmonyParser
from kvbatch.engine.reasoning.harmony_prompt import render_harmony_prompt
from tests.harmony_tokenizer import VOCAB_SIZE, build_harmony_tokenizer
from tests.jobs.local.test_run import chat, write_jsonl
from tests.jobs.openai_format.test_conformance import check_line
from tests.reference import hf_greedy
from tests.tiny_models import EOS, build_tiny_checkpoint

pytestmark = pytest.mark.slow  # the gpt-oss tokenizer's conversion: about 15 s of CPU

RETURN, CALL = 200002, 200012


@pytest.fixture(scope="module")
def gpt_oss_harmony(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt_oss_harmony") / "model"
    build_tiny_checkpoint("gpt-oss-mxfp4", path, vocab_size=VOCAB_SIZE)
    build_harmony_tokenizer(path)
    return path


def test_a_gpt_oss_folder_answers_as_transformers_split_as_harmony(
    gpt_oss_harmony: Path, tmp_path: Path
):
    messages = [{"role": "user", "content": "What makes the tides?"}]
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [chat("q", "", messages=messages, max_tokens=10, reasoning_effort="low")],
    )
    out = tmp_path / "out.jsonl"
    argv = ["run", str(src), "-o", str(out), "--model", str(gpt_oss_harmony), "--device",
            "cpu", "--threads", "1", "--kv-cache-bytes", "16MiB"]  # fmt: skip
    assert main(argv) == 0
    (raw,) = out.read_text().splitlines()
    body = check_line(raw)["response"]["body"]
    [choice] = body["choices"]
    prompt = render_harmony_prompt(messages, reasoning_effort="low")
    assert body["usage"]["prompt_tokens"] == len(prompt)
    (tokens,) = hf_greedy(gpt_oss_harmony, [prompt], 10, False, [EOS, RETURN, CALL])
    assert body["usage"]["completion_tokens"] == len(tokens)
    split = HarmonyParser().split(prompt, tokens)
    message = choice["message"]
    assert message.get("reasoning_content") == split.reasoning
    assert message["content"] == split.content
    details = body["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == split.num_reasoning_tokens
    for text in (message.get("reasoning_content") or "", message["content"] or ""):
        assert "<|" not in text  # no special token leaks into either
