"""gpt-oss's harmony format read with openai-harmony, OpenAI's own parser.

An answer is a run of messages, each on a channel and ending on <|end|> (or the answer's
<|return|> or <|call|>); the generation prompt already wrote `<|start|>assistant`, so the
first header follows:

    <|channel|>analysis<|message|>...<|end|>                     -> reasoning_content
    <|start|>assistant<|channel|>commentary to=functions.f
        <|constrain|>json<|message|>{"x": 1}<|call|>             -> tool_calls (name f)
    <|start|>assistant<|channel|>final<|message|>...<|return|>   -> content

Only message text reaches the answer, never a special token. A cut answer (max_tokens) keeps
the message it was writing, on the channel its header named. Tokens the parser refuses (a
model that breaks the format) end the reading there: what was read is kept. Commentary with no
recipient (a preamble the user may see) joins the content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from openai_harmony import HarmonyEncoding, HarmonyError, Message, Role, StreamableParser

from kvbatch.engine.reasoning.harmony_vocab import harmony_encoding
from kvbatch.engine.reasoning.parser import ReasoningCall, ReasoningSplit

FUNCTIONS = "functions."


class HarmonyEnd:
    """Watches an answer for the header of a `final` message: the grammar of a structured
    output starts at that message's first token."""

    def __init__(self, encoding: HarmonyEncoding, channel_id: int, message_id: int) -> None:
        self.encoding = encoding
        self.channel_id, self.message_id = channel_id, message_id
        self.ended = False
        self._header: list[int] | None = None  # tokens after <|channel|>, until <|message|>

    def accept(self, token_id: int) -> None:
        if self.ended:
            return
        if token_id == self.channel_id:
            self._header = []
        elif token_id == self.message_id and self._header is not None:
            self.ended = channel_name(self.encoding.decode(self._header)) == "final"
            self._header = None
        elif self._header is not None:
            self._header.append(token_id)


def channel_name(header: str) -> str:
    """`final` of "final", "final <|constrain|>json" or "commentary to=functions.f"."""
    return header.split("<|", 1)[0].strip().split(" ", 1)[0]


class HarmonyParser:
    """Splits a gpt-oss answer by channel (vLLM's `openai_gptoss`)."""

    name = "openai_gptoss"

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self.encoding = encoding or harmony_encoding()
        # <|return|> and <|call|>: the answer's end, or a call waiting for its result
        self.stop_token_ids = tuple(self.encoding.stop_tokens_for_assistant_actions())
        self.channel_id, self.message_id = self._token("<|channel|>"), self._token("<|message|>")
        self.end_ids = frozenset(self._token(t) for t in ("<|end|>", "<|return|>", "<|call|>"))

    def _token(self, text: str) -> int:
        (token,) = self.encoding.encode(text, allowed_special={text})
        return token

    def reasoning_end(self, prompt_token_ids: Sequence[int]) -> HarmonyEnd:
        return HarmonyEnd(self.encoding, self.channel_id, self.message_id)

    def split(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> ReasoningSplit:
        messages, partial, counts = self.read(output_token_ids)
        reasoning, content, calls = [], [], []
        for message in messages + ([partial] if partial is not None else []):
            text = "".join(getattr(c, "text", "") for c in message.content)
            if message.recipient is not None and message is not partial:
                calls.append(_call(message.recipient, text))
            elif message.channel == "analysis" or message.channel is None:
                reasoning.append(text)
            elif message.recipient is None:  # final, or a commentary preamble
                content.append(text)
        return ReasoningSplit(
            "\n".join(reasoning) if reasoning else None,
            "\n".join(content) if content else None,
            counts,
            calls,
        )

    def read(self, output_token_ids: Sequence[int]) -> tuple[list[Message], Message | None, int]:
        """The messages of an answer, the one it was cut in (None if none), and how many of
        its tokens belong to the reasoning (analysis messages, framing included).

        openai-harmony's parser reads the whole answer at once; an answer it refuses (the
        format broken somewhere, or cut inside a header) is read again token by token, and
        kept up to the break."""
        try:
            messages = self.encoding.parse_messages_from_completion_tokens(
                output_token_ids, Role.ASSISTANT
            )
        except HarmonyError:
            return self._read_until_broken(output_token_ids)
        lengths = self._message_lengths(output_token_ids)
        if len(lengths) != len(messages):
            return self._read_until_broken(output_token_ids)
        reasoning_tokens = sum(n for m, n in zip(messages, lengths) if m.channel == "analysis")
        partial = None
        if output_token_ids and output_token_ids[-1] not in self.end_ids and messages:
            partial = messages.pop()  # cut by max_tokens inside its content
        return messages, partial, reasoning_tokens

    def _message_lengths(self, output_token_ids: Sequence[int]) -> list[int]:
        """Tokens per message: each runs to its <|end|>, <|return|> or <|call|>, the last
        one possibly cut short."""
        lengths, since = [], 0
        for token in output_token_ids:
            since += 1
            if token in self.end_ids:
                lengths.append(since)
                since = 0
        return lengths + [since] if since else lengths

    def _read_until_broken(self, output_token_ids: Sequence[int]):
        parser = StreamableParser(self.encoding, Role.ASSISTANT)
        num_messages, since, reasoning_tokens = 0, 0, 0
        for token in output_token_ids:
            try:
                parser.process(token)
            except HarmonyError:
                break  # the format is broken here: keep what was read
            since += 1
            if token in self.end_ids and len(parser.messages) > num_messages:
                num_messages = len(parser.messages)
                if parser.messages[-1].channel == "analysis":
                    reasoning_tokens += since
                since = 0
        messages = parser.messages
        partial = None
        if parser.current_content or parser.current_channel is not None:
            partial = Message.from_role_and_content(Role.ASSISTANT, parser.current_content)
            partial.channel = parser.current_channel
            partial.recipient = parser.current_recipient
        if partial is None or partial.channel in ("analysis", None):
            reasoning_tokens += since
        return messages, partial, reasoning_tokens


def _call(recipient: str, arguments: str) -> ReasoningCall:
    """A call to `functions.NAME` (another recipient, a built-in tool, keeps its full name);
    arguments that are JSON are written compactly, as the other tool-call parsers write them."""
    name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient
    try:
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        pass
    return ReasoningCall(name, arguments)
