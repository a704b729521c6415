"""Chat conversations to prompts through a chat template (`LLM.chat` and the HTTP server).

A conversation is a list of messages, each a dict with a "role" and a "content" that is a
string or a list of text parts (`{"type": "text", "text": ...}`, joined); other keys (such as
"name") are handed to the template as they are. The template is the tokenizer's, or the one
given (a Jinja string); the rendered text is tokenized without adding special tokens (the
template writes the ones it wants), as vLLM does.
"""

from __future__ import annotations

from typing import Any

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "chat_template"})
"""Names the template call sets itself; `chat_template_kwargs` may not set them."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def normalize_conversation(conversation, where: str = "messages") -> list[dict[str, Any]]:
    """The messages as the template reads them; ValueError naming `where` for one that is
    not a dict with a string role and string (or text-part list) content."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where} must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string 'role'")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            try:
                content = "".join(part["text"] for part in content if part.get("type") == "text")
            except (AttributeError, KeyError, TypeError):
                raise ValueError(f"{where}[{i}].content must be a string or a list of "
                                 '{"type": "text", "text": ...} parts') from None
        elif content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        messages.append({**message, "content": content})
    return messages


def render_chat(tokenizer, conversation: list[dict[str, Any]], *,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids) of one normalized conversation.

    ValueError when there is no template (the tokenizer has none and none is given), or the
    template fails on this conversation (the message says why; `messages` is the field).
    """
    text = render_chat_text(tokenizer, conversation, chat_template=chat_template,
                            add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message,
                            chat_template_kwargs=chat_template_kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(tokenizer, conversation: list[dict[str, Any]], *,
                     chat_template: str | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The rendered prompt alone, untokenized (`render_chat`'s first half, same errors)."""
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("chat_template is required: this model's tokenizer has no chat "
                         "template; pass chat_template= (a Jinja template string), or use "
                         "generate() with a prompt")
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except Exception as exc:  # template errors come from the conversation or the template
        raise ValueError(f"messages: the chat template failed on them: {exc}") from None
    return text
