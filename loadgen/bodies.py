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
from dataclasses import dataclass
from typing import Any

import orjson

from weighbridge.loadgen.identity import AGENTIC_CONTEXT, agentic_context
from weighbridge.loadgen.plan import Message, RequestPlan
from weighbridge.loadgen.tenants import ENDPOINT_PATHS, TenantSpec

__all__ = ["TRACE_BLOCK", "BodyOptions", "ChatFraming", "block_sizes", "build_body",
           "message_token_ids", "prompt_fields", "prompt_text", "prompt_token_ids",
           "request_fields"]

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


@dataclass(frozen=True, slots=True)
class BodyOptions:
    """What a tenant adds to every body besides its plan: ``ignore_eos``, continuous usage,
    vLLM's ``priority``, and vllm-router's agentic context (weighbridge.loadgen.identity)."""

    ignore_eos: bool = True
    continuous_usage: bool = False
    priority: int | None = None
    agentic_context: bool = False

    @classmethod
    def of(cls, tenant: TenantSpec) -> BodyOptions:
        return cls(ignore_eos=tenant.ignore_eos, continuous_usage=tenant.continuous_usage,
                   priority=tenant.priority,
                   agentic_context=AGENTIC_CONTEXT in tenant.identity)


def request_fields(plan: RequestPlan, options: BodyOptions, model: str | None = None
                   ) -> dict[str, Any]:
    """Every field of ``plan``'s body but its prompt. The simulator gives these to the
    sidecar with the prompt counted from the plan; :func:`build_body` adds the prompt. Its
    ``model`` is the plan's (the tenant's, else the run's), else ``model``; none when neither
    is set. The endpoint is the plan's: a replayed row may name its own."""
    model = plan.model or model
    body: dict[str, Any] = {}
    embeddings = plan.endpoint == ENDPOINT_PATHS["embeddings"]
    if not embeddings:
        body.update(max_tokens=plan.max_tokens, stream=plan.stream)
    if model:
        body["model"] = model
    if plan.session_id is not None and plan.endpoint == ENDPOINT_PATHS["completions"]:
        body["return_token_ids"] = True  # the answer's ids go back in the next turn
    if options.ignore_eos and not embeddings:
        body["ignore_eos"] = True
    if plan.stream:
        stream_options = {"include_usage": True}
        if options.continuous_usage:
            stream_options["continuous_usage_stats"] = True
        body["stream_options"] = stream_options
    if plan.user is not None:
        body["user"] = plan.user
    if options.priority is not None:
        body["priority"] = options.priority
    if options.agentic_context and (context := agentic_context(plan)) is not None:
        body["vllm_xargs"] = {"agentic_context": context}
    return body


def prompt_fields(plan: RequestPlan, chat_words: int | None = None) -> dict[str, Any]:
    """``plan``'s prompt as its endpoint takes it: chat messages (``chat_words`` words for a
    prefix-free one), completions token ids, or an embeddings request's token-id
    ``input``."""
    if plan.endpoint == ENDPOINT_PATHS["embeddings"]:
        return {"input": prompt_token_ids(plan.prompt_tokens, plan.content_seed)}
    chat = plan.endpoint == ENDPOINT_PATHS["chat"]
    if plan.messages is not None:
        if chat:
            return {"messages": [{"role": m.role, "content": _message_text(m)}
                                 for m in plan.messages]}
        return {"prompt": [i for m in plan.messages for i in message_token_ids(m)]}
    if chat:
        words = plan.prompt_tokens if chat_words is None else chat_words
        return {"messages": [{"role": "user",
                              "content": prompt_text(words, plan.content_seed)}]}
    return {"prompt": prompt_token_ids(plan.prompt_tokens, plan.content_seed)}


def build_body(plan: RequestPlan, tenant: TenantSpec, model: str | None = None,
               chat_words: int | None = None) -> bytes:
    """The JSON body for ``plan`` as ``tenant`` sends it: :func:`request_fields` and the
    prompt (:func:`prompt_fields`)."""
    body = request_fields(plan, BodyOptions.of(tenant), model)
    body.update(prompt_fields(plan, chat_words))
    return orjson.dumps(body)
