"""Request bodies of exactly the drawn size.

Completions prompts are token ids, so the prompt is exactly ``prompt_tokens`` long on any
server. Chat prompts are text: words that are one token each under common tokenizers (and
exactly under the emulator's), minus the chat template's framing, which
:class:`ChatFraming` learns from the server's ``usage`` and which the driver checks on every
response. Outputs are exactly ``max_tokens`` long with ``ignore_eos`` (a vLLM extension;
tenants can turn it off for servers that refuse it).

In prefix-free mode every prompt starts with a few tokens drawn from the request's own
seed, so no two prompts share a prefix and a server's prefix cache does not make them cheaper
than real traffic. A plan with ``messages`` (a system prompt, a session's history, a trace's
blocks) is rendered part by part, each from its own seed, so parts that are the same in two
requests are the same tokens: completions send the token ids of every part in order, chat
sends alternating messages (a trace's blocks as one user message). A session's answers go
back as the server returned them: chat as the answer's text, completions as its token ids
(``return_token_ids``, which vLLM answers with ``token_ids``; a server that sends none gets
ids of the answer's length drawn from the turn, so the lengths stay exact but its cache
cannot hit on the answer).
"""

from __future__ import annotations

import random
from typing import Any

import orjson

from weighbridge.loadgen.plan import Message, RequestPlan
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["TRACE_BLOCK", "ChatFraming", "block_sizes", "build_body", "message_token_ids",
           "prompt_text", "prompt_token_ids"]

TRACE_BLOCK = 512  # tokens per hash id of a Mooncake trace

_FIRST_ID = 6  # ids below are special tokens in the tiny model
_ID_SPAN = 500  # ids stay below 506: inside any real vocabulary
_UNIQUE_HEAD = 8  # tokens drawn per request before the shared pattern
_PATTERN = [_FIRST_ID + (i * 7919) % _ID_SPAN for i in range(8192)]

# One-token words (a leading space and at most four letters).
_WORDS = (" the", " a", " of", " to", " and", " in", " is", " it", " that", " for", " on",
          " with", " as", " was", " at", " by", " this", " from", " or", " but", " not",
          " are", " have", " one", " all", " we", " can", " more", " time", " when", " data")


def prompt_token_ids(n: int, content_seed: int) -> list[int]:
    rng = random.Random(content_seed)
    head = [rng.randrange(_FIRST_ID, _FIRST_ID + _ID_SPAN) for _ in range(min(n, _UNIQUE_HEAD))]
    rest = n - len(head)
    tail: list[int] = []
    while rest > 0:
        take = min(rest, len(_PATTERN))
        tail += _PATTERN[:take]
        rest -= take
    return head + tail


def _words(n: int, content_seed: int) -> list[str]:
    rng = random.Random(content_seed)
    head = [rng.choice(_WORDS) for _ in range(min(n, _UNIQUE_HEAD))]
    return head + [_WORDS[i % len(_WORDS)] for i in range(n - len(head))]


def prompt_text(words: int, content_seed: int) -> str:
    return "".join(_words(words, content_seed)).lstrip()


def block_sizes(tokens: int, blocks: int) -> list[int]:
    """Tokens of each of a trace prompt's ``blocks``: whole blocks and a last partial one;
    a length beyond the blocks lengthens the last (Mooncake's last id covers the rest)."""
    if blocks == 0:
        return []
    sizes = [min(TRACE_BLOCK, max(0, tokens - i * TRACE_BLOCK)) for i in range(blocks)]
    sizes[-1] += max(0, tokens - blocks * TRACE_BLOCK)
    return sizes


def message_token_ids(message: Message) -> list[int]:
    """The token ids of one part of a prompt (an answer: the ids the server returned)."""
    if message.blocks is not None:
        return [i for size, seed in zip(block_sizes(message.tokens, len(message.blocks)),
                                        message.blocks, strict=True)
                for i in prompt_token_ids(size, seed)]
    if message.token_ids is not None:
        return list(message.token_ids)
    return prompt_token_ids(message.tokens, message.content_seed)


def _message_text(message: Message) -> str:
    if message.blocks is not None:
        return "".join(w for size, seed in zip(block_sizes(message.tokens, len(message.blocks)),
                                               message.blocks, strict=True)
                       for w in _words(size, seed)).lstrip()
    if message.text is not None:
        return message.text
    return prompt_text(message.tokens, message.content_seed)


class ChatFraming:
    """The chat template's overhead in prompt tokens, learned from the server's usage: the
    last observation wins (a template does not change during a run)."""

    def __init__(self, overhead: int = 0) -> None:
        self.overhead = overhead
        self.observed = False

    def words_for(self, prompt_tokens: int) -> int:
        return max(1, prompt_tokens - self.overhead)

    def observe(self, words: int, usage_prompt_tokens: int) -> None:
        self.overhead = usage_prompt_tokens - words
        self.observed = True


def build_body(plan: RequestPlan, tenant: TenantSpec, model: str | None = None,
               chat_words: int | None = None) -> bytes:
    """The JSON body for ``plan``; chat requests carry ``chat_words`` words of text, an
    embeddings request its prompt as token-id ``input`` (nothing to generate or stream).
    Its ``model`` is the plan's (the tenant's, else the run's), else ``model``; none when
    neither is set."""
    model = plan.model or model
    body: dict[str, Any] = {}
    if tenant.endpoint == "embeddings":
        body["input"] = prompt_token_ids(plan.prompt_tokens, plan.content_seed)
    else:
        body.update(max_tokens=plan.max_tokens, stream=plan.stream)
    if model:
        body["model"] = model
    if plan.messages is not None:
        if tenant.endpoint == "chat":
            body["messages"] = [{"role": m.role, "content": _message_text(m)}
                                for m in plan.messages]
        else:
            body["prompt"] = [i for m in plan.messages for i in message_token_ids(m)]
        if plan.session_id is not None and tenant.endpoint == "completions":
            body["return_token_ids"] = True  # the answer's ids go back in the next turn
    elif tenant.endpoint == "chat":
        words = plan.prompt_tokens if chat_words is None else chat_words
        body["messages"] = [{"role": "user", "content": prompt_text(words, plan.content_seed)}]
    elif tenant.endpoint == "completions":
        body["prompt"] = prompt_token_ids(plan.prompt_tokens, plan.content_seed)
    if tenant.ignore_eos and tenant.endpoint != "embeddings":
        body["ignore_eos"] = True
    if plan.stream:
        options = {"include_usage": True}
        if tenant.continuous_usage:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    if plan.user is not None:
        body["user"] = plan.user
    if tenant.priority is not None:
        body["priority"] = tenant.priority
    return orjson.dumps(body)
