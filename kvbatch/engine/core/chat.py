"""Conversations -> prompts through the model's own chat template, for `LLM.chat`.

The template's text already holds the special tokens (BOS, role markers), so it is encoded
without adding any: encoding it as a plain prompt would put a second BOS in front for
tokenizers that add one. This is what jobs/openai_format/prompts.py does for a batch line's messages and
what vLLM's `LLM.chat` does, so the same conversation gives the same tokens everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Message = Mapping[str, object]
Conversation = Sequence[Message]


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[list[Message]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations.
    Raises ValueError, saying the expected shape, for anything else."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(_SHAPE + f"; got {type(messages).__name__} {messages!r:.60}")
    if all(isinstance(m, Mapping) for m in messages):
        conversations = [list(messages)]
    else:
        conversations = [list(c) for c in messages]
    for i, conversation in enumerate(conversations):
        for j, message in enumerate(conversation):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(_SHAPE + f"; conversation {i} message {j} is {message!r:.60}")
    return conversations


_SHAPE = 'chat takes one conversation [{"role": "user", "content": "..."}, ...] or a list of them'


def require_chat_template(tokenizer, chat_template: str | None = None) -> None:
    """Raise ValueError, saying what to do, when there is no template to apply at all."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template: pass token ids")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model has no chat template: pass chat_template= (a Jinja template) or use "
            "generate() with plain prompts"
        )


def render_chat(
    tokenizer,
    conversation: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> dict:
    """The engine prompt of one conversation: {"prompt": text, "prompt_token_ids": ids}.
    Whatever the template raises for these messages propagates."""
    text = tokenizer.apply_chat_template(
        list(conversation),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
        **dict(chat_template_kwargs or {}),
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
