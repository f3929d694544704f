"""The harmony parser and prompts against openai-harmony itself, on its offline vocabulary."""

from __future__ import annotations

import hashlib
import os

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from kvbatch.engine.reasoning.harmony import HarmonyParser
from kvbatch.engine.reasoning.harmony_prompt import render_harmony_prompt
from kvbatch.engine.reasoning.harmony_vocab import (
    ENCODINGS_ENV,
    O200K_BASE_FILE,
    O200K_BASE_SHA256,
    harmony_encoding,
    harmony_encodings_dir,
    o200k_base_from_bpe_openai,
)


@pytest.fixture(scope="module")
def encoding():
    return harmony_encoding()


@pytest.fixture(scope="module")
def parser(encoding):
    return HarmonyParser(encoding)


def tokens(encoding, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def test_vocab_is_the_published_file(tmp_path):
    data = o200k_base_from_bpe_openai()
    assert hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256
    assert data.count(b"\n") == 199_998
    folder = harmony_encodings_dir(tmp_path)
    assert folder == tmp_path / "tiktoken"
    assert (folder / O200K_BASE_FILE).read_bytes() == data


def test_encoding_loads_from_the_cache_folder(encoding):
    """openai-harmony read the file kvbatch wrote (no download: this machine has no network)."""
    path = os.path.join(os.environ[ENCODINGS_ENV], O200K_BASE_FILE)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == O200K_BASE_SHA256
    assert set(encoding.stop_tokens_for_assistant_actions()) == {200002, 200012}


STREAMS = {
    "final": "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
    "call": "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>',
    "cut in analysis": "<|channel|>analysis<|message|>Let me think about the fir",
    "cut in final": "<|channel|>analysis<|message|>Short.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is",
    "no analysis": "<|channel|>final<|message|>Hello there.<|return|>",
    "two analyses": "<|channel|>analysis<|message|>One.<|end|><|start|>assistant"
    "<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Done.<|return|>",
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_split_equals_openai_harmony_parser(encoding, parser, name):
    """Each channel's text as openai-harmony's own (non-streaming) parser reads it."""
    output = tokens(encoding, STREAMS[name])
    reference = encoding.parse_messages_from_completion_tokens(output, Role.ASSISTANT)
    by_channel: dict[str, list[str]] = {}
    calls = []
    for message in reference:
        text = "".join(c.text for c in message.content)
        if message.recipient is not None and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), text))
        else:
            by_channel.setdefault(message.channel, []).append(text)
    split = parser.split([], output)
    expected_reasoning = by_channel.get("analysis")
    assert split.reasoning == ("\n".join(expected_reasoning) if expected_reasoning else None)
    expected_final = by_channel.get("final")
    if name == "call":
        assert split.content is None
        assert [(c.name, c.arguments) for c in split.calls] == calls
    else:
        assert split.content == ("\n".join(expected_final) if expected_final else None)
        assert not split.calls
    for text in (split.reasoning or "", split.content or ""):
        assert "<|" not in text  # no special token ever leaks


def test_cut_in_analysis_is_all_reasoning(encoding, parser):
    output = tokens(encoding, STREAMS["cut in analysis"])
    split = parser.split([], output)
    assert split.reasoning == "Let me think about the fir"
    assert split.content is None
    assert split.num_reasoning_tokens == len(output)


def test_reasoning_tokens_count_the_analysis_messages(encoding, parser):
    analysis = tokens(encoding, "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>")
    output = tokens(encoding, STREAMS["final"])
    assert output[: len(analysis)] == analysis
    assert parser.split([], output).num_reasoning_tokens == len(analysis)


def test_broken_format_keeps_what_was_read(encoding, parser):
    good = tokens(encoding, "<|channel|>analysis<|message|>fine<|end|>")
    split = parser.split([], good + tokens(encoding, "garbage<|message|>") + [5, 6])
    assert split.reasoning == "fine"
    assert "<|" not in (split.content or "")
    cut_in_header = good + tokens(encoding, "<|start|>assistant<|channel|>fin")
    split = parser.split([], cut_in_header)  # openai-harmony's one-shot parser refuses it
    assert (split.reasoning, split.content) == ("fine", None)
    assert split.num_reasoning_tokens == len(cut_in_header)


def test_reasoning_end_at_the_final_header(encoding, parser):
    output = tokens(encoding, STREAMS["final"])
    end = parser.reasoning_end([])
    ended_at = None
    for i, token in enumerate(output):
        end.accept(token)
        if end.ended and ended_at is None:
            ended_at = i
    header = tokens(encoding, "<|channel|>final<|message|>")
    start = STREAMS["final"].index("<|channel|>final")
    assert ended_at == len(tokens(encoding, STREAMS["final"][:start])) + len(header) - 1
    constrained = parser.reasoning_end([])
    for token in tokens(encoding, "<|channel|>final <|constrain|>json<|message|>"):
        constrained.accept(token)
    assert constrained.ended
    commentary = parser.reasoning_end([])
    for token in tokens(encoding, "<|channel|>commentary to=functions.f<|message|>{}"):
        commentary.accept(token)
    assert not commentary.ended


# --- prompts ----------------------------------------------------------------------------------


def test_prompt_equals_openai_harmony_rendering(encoding):
    """system (-> developer instructions), user, reasoning_effort: as harmony renders the
    conversation built by hand."""
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is the capital of Italy?"},
    ]
    ours = render_harmony_prompt(messages, reasoning_effort="high")
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)
    reference = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer in French.")
            ),
            Message.from_role_and_content(Role.USER, "What is the capital of Italy?"),
        ]
    )
    assert ours == encoding.render_conversation_for_completion(reference, Role.ASSISTANT)
    text = encoding.decode(ours)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    assert "# Instructions\n\nAnswer in French." in text


def test_developer_message_is_the_instructions_too(encoding):
    user = {"role": "user", "content": "Hi"}
    as_developer = render_harmony_prompt([{"role": "developer", "content": "Be brief."}, user])
    as_system = render_harmony_prompt([{"role": "system", "content": "Be brief."}, user])
    assert as_developer == as_system
    no_instructions = encoding.decode(render_harmony_prompt([user], reasoning_effort="low"))
    assert "<|start|>developer" not in no_instructions and "Reasoning: low" in no_instructions


def test_prompt_with_tools_and_history(encoding):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    ours = render_harmony_prompt(messages, tools=tools)
    developer = DeveloperContent.new().with_function_tools(
        [
            ToolDescription.new(
                "get_weather",
                "Weather of a city",
                {"type": "object", "properties": {"city": {"type": "string"}}},
            )
        ]
    )
    reference = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Weather in Paris?"),
            Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            Message.from_author_and_content(
                Author.new(Role.TOOL, "functions.get_weather"), "sunny"
            ).with_channel("commentary"),
        ]
    )
    assert ours == encoding.render_conversation_for_completion(reference, Role.ASSISTANT)
    text = encoding.decode(ours)
    assert "namespace functions" in text and "Reasoning: medium" in text


def test_bad_reasoning_effort():
    with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
        render_harmony_prompt([{"role": "user", "content": "hi"}], reasoning_effort="extreme")
