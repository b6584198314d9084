"""The emulator's deterministic tokenizer and generated text.

There are no weights, so there is no vocabulary to learn; instead a documented rule that
anyone can reproduce counts tokens in a string: a token is an optional single space followed
by up to four word characters, or an optional single space followed by one other
non-whitespace character, or one whitespace character. Generated tokens are short words with
a leading space, each of which is exactly one token under the same rule, so re-tokenizing the
output gives back the output token count.
"""

from __future__ import annotations

import hashlib
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


# Token ids, which the prefix cache hashes. The generated words are a small vocabulary of
# ids from 6 (0-5 are the tiny model's special tokens), so an answer's ids are valid in a
# token-id prompt; any other token's id is a 63-bit hash of its text. The chat framing
# tokens are named like a template's.
BOS_ID = 1
FIRST_WORD_ID = 6
_WORD_IDS = {word: FIRST_WORD_ID + i for i, word in enumerate(_WORDS)}


def token_id(token: str) -> int:
    word = _WORD_IDS.get(token)
    if word is not None:
        return word
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest()) >> 1


def prompt_ids(text: str) -> tuple[int, ...]:
    """A completions prompt's token ids: BOS, then the text's tokens."""
    return (BOS_ID, *map(token_id, tokenize(text)))


def chat_ids(messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
    """A chat prompt's token ids for (role, content) messages: each message is its role's
    token, its content's, and an end token; the reply opens with the assistant's role token,
    so a next turn that resends the reply as an assistant message repeats these ids."""
    ids: list[int] = []
    for role, content in messages:
        ids.append(token_id(f"<|{role}|>"))
        ids.extend(map(token_id, tokenize(content)))
        ids.append(token_id("<|end|>"))
    ids.append(token_id("<|assistant|>"))
    return tuple(ids)


def count_chat_tokens(contents: Sequence[str]) -> int:
    """Prompt tokens of a chat request whose messages have these text contents."""
    return (
        sum(count_tokens(c) + CHAT_TOKENS_PER_MESSAGE for c in contents)
        + CHAT_TOKENS_REPLY_PRIMER
    )


def token_text(request_seed: int, index: int) -> str:
    """The text of output token ``index`` of a request: deterministic, one token each."""
    return _WORDS[(request_seed * 31 + index * 7) % len(_WORDS)]


def generated_token_id(request_seed: int, index: int) -> int:
    """The id of output token ``index`` of a request (its word's, as a prompt would give it)."""
    return _WORD_IDS[token_text(request_seed, index)]


def generated_token_ids(request_seed: int, start: int, count: int) -> list[int]:
    return [generated_token_id(request_seed, i) for i in range(start, start + count)]


def generated_text(request_seed: int, start: int, count: int) -> str:
    return "".join(token_text(request_seed, i) for i in range(start, start + count))
