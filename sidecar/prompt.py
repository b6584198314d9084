"""Prompt size at ingress, before any backend has tokenized it.

The sidecar has no tokenizer (it fronts any model), so it counts exactly what it can — a
token-id prompt is its length — and estimates the rest at four bytes of UTF-8 per token plus
a few tokens of chat framing per message, the usual rule of thumb for BPE vocabularies. The
estimate only orders and prices the request until the backend's ``usage`` settles it.
"""

from __future__ import annotations

from typing import Any

from weighbridge.endpoints import EndpointKind

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


def prompt_tokens(kind: EndpointKind, body: dict[str, Any]) -> int:
    """Exact for token-id prompts, an estimate for text. A token-id prompt is normalised in
    ``body`` to plain integers (the body is forwarded). A pooling request's prompt is every
    input's, and a score's or a rerank's every query's and document's (each an input of its
    own, as vLLM runs them for an embedding model; a cross-encoder's usage, which counts the
    query once per document, settles the difference)."""
    if kind is EndpointKind.CHAT:
        return _chat_tokens(body)
    if kind is EndpointKind.COMPLETIONS:
        return _input_tokens(body, "prompt")
    if kind is EndpointKind.RERANK:
        query = _score_side(body, "query", many=False)
        return _texts_tokens(query) + _texts_tokens(_score_side(body, "documents"))
    if kind is EndpointKind.SCORE:
        return _score_tokens(body)
    # Embeddings, /pooling and /classify take `input` in the forms of `prompt`, or a chat,
    # which vLLM reads first when a body has both.
    if isinstance(body.get("messages"), list):
        return _chat_tokens(body)
    return _input_tokens(body, "input")


def _chat_tokens(body: dict[str, Any]) -> int:
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


def _input_tokens(body: dict[str, Any], field: str) -> int:
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


# A score request's two sides, by the first pair of fields it has both of, in the order vLLM
# tries its request forms (vllm/entrypoints/pooling/scoring/protocol.py).
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                ("text_1", "text_2"))


def _score_tokens(body: dict[str, Any]) -> int:
    for first, second in _SCORE_SIDES:
        if body.get(first) is not None and body.get(second) is not None:
            queries, documents = _score_side(body, first), _score_side(body, second)
            if len(queries) > 1 and len(queries) != len(documents):
                # vLLM's rule: one query for every document, or one each.
                raise PromptError(f"{first} and {second} must be 1:1, 1:N or N:N")
            return _texts_tokens(queries) + _texts_tokens(documents)
    raise PromptError("a score request takes queries and documents (or items), data_1 and "
                      "data_2, or text_1 and text_2")


def _score_side(body: dict[str, Any], field: str, many: bool = True) -> list[str]:
    """The texts of a score or rerank field: a string or ``{"content": [parts]}`` (its text
    parts), or (``many``) a non-empty list of them."""
    value = body.get(field)
    items = value if many and isinstance(value, list) else [value]
    if not items:
        raise PromptError(f"{field} must not be empty")
    texts = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("content"), list):
            texts.append(content_text(item["content"], field))
        else:
            kinds = "a string or an object with content parts"
            raise PromptError(f"{field} must be {kinds}" + (", or a list of them" if many
                                                              else ""))
    return texts


def _texts_tokens(texts: list[str]) -> int:
    return sum(_text_tokens(text) for text in texts)


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
