"""Turning the prompt of a request into token ids: text through the
tokenizer, chat messages through the model's chat template, token ids
checked against the vocabulary (an id past the embedding would fail the
whole pass it rides in, and every request batched with it)."""

from __future__ import annotations

from typing import Any

from ringserve.http.errors import bad_request
from ringserve.http.schemas import ChatMessage, MessageToolCall
from ringserve.http.served import ServedModel
from ringserve.models.tokenizer import Tokenizer

PromptBody = str | list[str | int | list[int]]


def completion_prompts(served: ServedModel, prompt: PromptBody) -> list[list[int]]:
    """The token ids of each prompt a completion request carries."""
    if isinstance(prompt, str):
        return [encode_text(served, prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [checked_ids(served, prompt, "prompt")]
    if all(isinstance(p, str) for p in prompt):
        return [encode_text(served, p, "prompt") for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [checked_ids(served, p, "prompt") for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids, not a mixture",
        param="prompt",
    )


def chat_prompt(
    served: ServedModel,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    variables: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of the conversation rendered with the chat template,
    ending with the assistant's turn opened unless `add_generation_prompt`
    is off; `variables` holds more for the template (`tools`, the request's
    `chat_template_kwargs`, which may turn `add_generation_prompt` off too)."""
    tokenizer = _tokenizer(served, "messages")
    if variables is not None and "messages" in variables:
        raise bad_request(
            "chat_template_kwargs may not set messages: send them as messages",
            param="chat_template_kwargs",
        )
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt, variables)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    # The template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(
    served: ServedModel, text: str, param: str, *, add_special_tokens: bool = True
) -> list[int]:
    return _tokenizer(served, param).encode(text, add_special_tokens=add_special_tokens)


def checked_ids(served: ServedModel, ids: list[int], param: str) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} is out of range: the vocabulary has {served.vocab_size} tokens",
            param=param,
        )
    return list(ids)


def _tokenizer(served: ServedModel, param: str) -> Tokenizer:
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", param=param)
    return served.tokenizer


def _message(message: ChatMessage, i: int) -> dict[str, Any]:
    """A message as the chat template reads it, Hugging Face's shape."""
    out: dict[str, Any] = {"role": message.role, "content": _content(message, i)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """A tool call in Hugging Face's message shape; its arguments, JSON text
    as OpenAI sends them, the tokenizer turns into an object (for the
    offline API's messages alike)."""
    function = {"name": call.function.name, "arguments": call.function.arguments}
    return {"id": call.id, "type": call.type, "function": function}


def _content(message: ChatMessage, i: int) -> str:
    """Text content: a string, or the concatenated text parts."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    others = [p.type for p in content if p.type != "text"]
    if others:
        raise bad_request(
            f"messages[{i}] has a {others[0]!r} part; only text is supported",
            param=f"messages[{i}].content",
        )
    return "".join(p.text or "" for p in content)
