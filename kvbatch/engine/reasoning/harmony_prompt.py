"""Chat messages -> a gpt-oss prompt, rendered by openai-harmony (OpenAI's own renderer).

Neither transformers nor openai-harmony ships gpt-oss's Jinja chat template (it lives only
in the checkpoints), and the renderer is what OpenAI's reference and vLLM use for these
models, so kvbatch renders gpt-oss prompts with it, laid out as the checkpoints' template lays
them out:

    system     model identity, knowledge cutoff, `Reasoning: low|medium|high` (the request's
               reasoning_effort; medium when it gives none), the channels
    developer  `# Instructions` from the conversation's first system (or developer) message,
               and the request's function tools as harmony's `functions` namespace
    user       each user message
    assistant  an earlier answer on the final channel; its tool calls on commentary to
               `functions.NAME`; a tool's result as `functions.NAME` on commentary
    ...        then `<|start|>assistant`, the generation prompt

No conversation start date is written: a date that changes every day would change every
prompt, and with it the prefix cache and the answers of a rerun.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from kvbatch.engine.reasoning.harmony_vocab import harmony_encoding

REASONING_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}


def harmony_conversation(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> Conversation:
    """The harmony conversation of OpenAI chat `messages` (roles system, developer, user,
    assistant, tool) with `tools` ([{type: function, function: {name, description,
    parameters}}]). Raises ValueError for a reasoning_effort harmony does not define."""
    effort = REASONING_EFFORTS.get(reasoning_effort or "medium")
    if effort is None:
        raise ValueError(
            f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}"
        )
    out = [
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort)
        )
    ]
    rest = list(messages)
    instructions = None
    if rest and rest[0]["role"] in ("system", "developer"):
        instructions = _text(rest.pop(0).get("content"))
    if instructions is not None or tools:
        developer = DeveloperContent.new()
        if instructions is not None:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([_tool(t) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for message in rest:
        out.extend(_messages(message, call_names))
    return Conversation.from_messages(out)


def render_harmony_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    encoding: HarmonyEncoding | None = None,
) -> list[int]:
    """The prompt's token ids, ending with `<|start|>assistant` (harmony_conversation)."""
    encoding = encoding or harmony_encoding()
    conversation = harmony_conversation(messages, tools=tools, reasoning_effort=reasoning_effort)
    return encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)


def _messages(message: Mapping[str, Any], call_names: dict[str, str]) -> list[Message]:
    role, text = message["role"], _text(message.get("content"))
    if role in ("system", "developer"):
        return [
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions(text)
            )
        ]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if role == "tool":
        name = message.get("name") or call_names.get(message.get("tool_call_id") or "", "")
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [Message.from_author_and_content(author, text).with_channel("commentary")]
    out = []
    if text:
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        call_names[call.get("id", "")] = function["name"]
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{function['name']}")
            .with_content_type("<|constrain|>json")
        )
    return out


def _tool(tool: Mapping[str, Any]) -> ToolDescription:
    function = tool["function"]
    return ToolDescription.new(
        function["name"], function.get("description", ""), function.get("parameters")
    )


def _text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if isinstance(part, Mapping))
