"""The emulator's deterministic tokenizer and generated text.

There are no weights, so there is no vocabulary to learn; instead a documented rule that
anyone can reproduce counts tokens in a string: a token is an optional single space followed
by up to four word characters, or an optional single space followed by one other
non-whitespace character, or one whitespace character. Generated tokens are short words with
a leading space, each of which is exactly one token under the same rule, so re-tokenizing the
output gives back the output token count.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TOKEN = re.compile(r" ?\w{1,4}| ?[^\w\s]|\s")

# Chat framing, as a chat template would add it: one token opening each message (its role),
# one closing it, and one opening the assistant's reply.
CHAT_TOKENS_PER_MESSAGE = 2
CHAT_TOKENS_REPLY_PRIMER = 1

_WORDS = (
    " the", " a", " of", " to", " and", " in", " is", " it", " that", " for", " on", " with",
    " as", " was", " at", " by", " this", " from", " or", " but", " not", " are", " have",
    " one", " all", " we", " can", " more", " time", " when", " data", " will", " each",
    " load", " fair", " cue", " word", " tier", " wait", " fast", " slow", " long",
)


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def count_chat_tokens(contents: Sequence[str]) -> int:
    """Prompt tokens of a chat request whose messages have these text contents."""
    return (
        sum(count_tokens(c) + CHAT_TOKENS_PER_MESSAGE for c in contents)
        + CHAT_TOKENS_REPLY_PRIMER
    )


def token_text(request_seed: int, index: int) -> str:
    """The text of output token ``index`` of a request: deterministic, one token each."""
    return _WORDS[(request_seed * 31 + index * 7) % len(_WORDS)]


def generated_text(request_seed: int, start: int, count: int) -> str:
    return "".join(token_text(request_seed, i) for i in range(start, start + count))
