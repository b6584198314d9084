"""Prompt size at ingress, before any backend has tokenized it.

The sidecar has no tokenizer (it fronts any model), so it counts exactly what it can — a
token-id prompt is its length — and estimates the rest at four bytes of UTF-8 per token plus
a few tokens of chat framing per message, the usual rule of thumb for BPE vocabularies. The
estimate only orders and prices the request until the backend's ``usage`` settles it.
"""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4
# No vocabulary has a token id beyond int64, vLLM's type for ids.
TOKEN_ID_MAX = 2**63 - 1
CHAT_TOKENS_PER_MESSAGE = 4


class PromptError(ValueError):
    """The body's prompt or messages are not what the endpoint accepts."""


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise PromptError(f"{where}: content parts must be objects")
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
        return "".join(parts)
    raise PromptError(f"{where}: content must be a string or a list of parts")


def prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """Exact for token-id prompts, an estimate for text. A token-id prompt is normalised in
    ``body`` to plain integers (the body is forwarded)."""
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list")
        total = 1
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise PromptError(f"messages[{i}] must be an object")
            text = content_text(message.get("content"), f"messages[{i}]")
            total += CHAT_TOKENS_PER_MESSAGE + (_text_tokens(text) if text else 0)
        return total
    # /v1/embeddings takes its text or token ids in `input`, in the forms of `prompt`.
    field = "input" if endpoint.endswith("/embeddings") else "prompt"
    prompt = body.get(field)
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError(f"{field} must not be empty")
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if (ids := _token_ids(prompt)) is not None:
            body[field] = ids
            return len(ids)
        if all(isinstance(p, str) for p in prompt):
            return sum(_text_tokens(p) for p in prompt)
        batch = [_token_ids(p) if isinstance(p, list) and p else None for p in prompt]
        if all(ids is not None for ids in batch):
            body[field] = batch
            return sum(len(ids) for ids in batch if ids is not None)
    raise PromptError(f"{field} must be a non-empty string, list of strings, list of token "
                      "ids or list of lists of token ids")


def json_integer(value: Any) -> int | None:
    """``value`` as an integer, or None when it is not one. An integral float is an integer
    (JSON Schema's rule, and vLLM's lax one: 54.0 is 54); a boolean is not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _token_ids(values: list[Any]) -> list[int] | None:
    """``values`` as token ids, or None when they are not integers. An integer outside
    int64, or a negative one, is no token of any vocabulary: refused as vLLM refuses it
    (a JSON integer beyond 64 bits arrives from the parser as a float)."""
    # The common prompt is plain integers already: one pass at C speed, no copy (a bool's
    # type is bool, not int, so it takes the slow path and is refused there).
    if all(type(value) is int for value in values):
        ids = values
    else:
        converted = [json_integer(value) for value in values]
        if any(i is None for i in converted):
            return None
        ids = [i for i in converted if i is not None]
    low, high = min(ids), max(ids)
    if low < 0 or high > TOKEN_ID_MAX:
        raise PromptError(f"Token id {low if low < 0 else high} is out of vocabulary")
    return ids
