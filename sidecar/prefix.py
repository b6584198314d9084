"""Which prompt prefixes each backend's prefix cache holds, as far as the sidecar can tell.

vLLM caches a prompt's KV in full blocks of ``block_size`` tokens, each named by a hash
chained over every token before it, and a new request reuses its longest run of cached
blocks from the start, but never its last token (vLLM always computes at least one). The
sidecar sees the prompts it sends, so it keeps, per backend, the chained hashes of the
blocks it sent there and predicts what a new prompt would find cached:

- a token-id prompt is cut exactly as the engine cuts it, at the engine's block size;
- a text prompt (the sidecar has no tokenizer) is cut into blocks of
  ``TEXT_BLOCK_BYTES`` bytes of its UTF-8, and a cached block is worth
  ``TEXT_BLOCK_BYTES / BYTES_PER_TOKEN`` tokens, the same estimate ``sidecar.prompt``
  prices text with.

Each backend's index is bounded by the engine's KV cache in blocks
(``vllm:cache_config_info``) and forgets the least recently used block first, a prompt's
last block before its first (as vLLM frees a request's blocks tail first into its free-block
queue). What the engine reports (a request's ``usage.prompt_tokens_details.cached_tokens``)
corrects the bound: the engine keeps fewer blocks than its whole cache while requests run,
so a prediction the engine did not meet shrinks the index to what it retains. The index is
a pure, clock-free core: the caller says when a block was used by the order of its calls.

Block hashes are ints made of ints only, so every process names a block alike: replicas
sharing their state tell each other the blocks they sent where (sidecar.shared), and each
index learns the others' dispatches as its own.

Invariants (``tests/unit/sidecar/test_prefix.py``): an index never holds more than its
capacity; a prediction never exceeds the prompt less one token and counts leading blocks
only (a hit is a prefix); a prompt just sent or settled is predicted whole, but for its last
token; a prediction the engine missed shrinks the index, one it met grows it back, never
past the engine's cache.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weighbridge.sidecar.prompt import BYTES_PER_TOKEN, content_text

TEXT_BLOCK_BYTES = 64  # 16 estimated tokens: vLLM's default block size
# A text block read as eight 64-bit words (as fast as hashing its bytes: 42 against 37 us a
# 4 KB prompt, where one big int of it took 69).
_TEXT_BLOCK_WORDS = struct.Struct(f"<{TEXT_BLOCK_BYTES // 8}Q")
_ROOT = 0x5EED  # the chain's start, so an empty prefix hashes to no block's value


@dataclass(slots=True, eq=False)
class PromptPrefix:
    """A request's prompt as the prefix index reads it: its token ids (exact) or its text
    (estimated; a chat's ``messages`` become text when first read), with the chained block
    hashes computed once per block size, when an index first asks for them."""

    token_ids: Sequence[int] | None = None
    text: bytes | None = None
    messages: Sequence[dict[str, Any]] | None = None
    _blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, endpoint: str, body: dict[str, Any]) -> PromptPrefix | None:
        """The prompt of a body ``sidecar.prompt`` has validated: a completion's token ids
        or text, a chat's messages as role and text in order; None for a batch of prompts
        and for embeddings (one engine request per input, or no generation)."""
        if endpoint.endswith("/chat/completions"):
            return cls(messages=body["messages"])
        if endpoint.endswith("/embeddings"):
            return None
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return cls(text=prompt.encode())
        if prompt and all(type(p) is int for p in prompt):
            return cls(token_ids=prompt)
        return None

    @property
    def exact(self) -> bool:
        return self.token_ids is not None

    def tokens_per_block(self, block_size: int) -> int:
        """Prompt tokens one cached block is worth."""
        return block_size if self.exact else TEXT_BLOCK_BYTES // BYTES_PER_TOKEN

    def blocks(self, block_size: int) -> tuple[int, ...]:
        """The chained hashes of the prompt's full blocks."""
        found = self._blocks.get(block_size)
        if found is None:
            found = self._blocks[block_size] = self._hash(block_size)
        return found

    def _hash(self, block_size: int) -> tuple[int, ...]:
        hashes: list[int] = []
        parent = _ROOT
        if self.token_ids is not None:
            ids = self.token_ids
            for start in range(0, len(ids) - block_size + 1, block_size):
                parent = hash((parent, *ids[start:start + block_size]))
                hashes.append(parent)
        elif self.text is not None or self.messages is not None:
            if self.text is None:
                assert self.messages is not None
                self.text = "".join(f"{m.get('role')}\x00{content_text(m.get('content'), '')}\x00"
                                    for m in self.messages).encode()
            text = self.text
            words = _TEXT_BLOCK_WORDS.unpack_from
            # Hashed as ints, not as bytes: str and bytes hashes differ between processes
            # (PYTHONHASHSEED), ints' do not, so replicas name a block alike (sidecar.shared).
            for start in range(0, len(text) - TEXT_BLOCK_BYTES + 1, TEXT_BLOCK_BYTES):
                parent = hash((parent, *words(text, start)))
                hashes.append(parent)
        return tuple(hashes)


class PrefixIndex:
    """One backend's cached blocks as the sidecar predicts them: an LRU set of chained
    block hashes, at most ``capacity_blocks`` of them (0: the engine's cache is not known
    yet, and nothing is predicted cached)."""

    def __init__(self, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError("capacity_blocks must be at least 0 and block_size at least 1")
        self.capacity_blocks = capacity_blocks
        # What the engine is learned to keep (``settle``): at most its whole cache.
        self.retained_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity_blocks: int, block_size: int) -> None:
        """The engine's cache shape became known (or changed): a new block size names other
        blocks, so the index starts over; a smaller capacity forgets the oldest."""
        if block_size != self.block_size:
            self._blocks.clear()
            self.block_size = block_size
        if capacity_blocks != self.capacity_blocks:
            self.capacity_blocks = max(0, capacity_blocks)
            self.retained_blocks = self.capacity_blocks
        self._evict()

    def snapshot(self, reported: bool = True) -> dict[str, int | bool]:
        """What /admin/state shows of the index; ``reported``: the engine's answers say what
        they found cached (the index is off without)."""
        return {"blocks": len(self._blocks), "retained_blocks": self.retained_blocks,
                "capacity_blocks": self.capacity_blocks, "block_size": self.block_size,
                "reported": reported}

    def matched_blocks(self, prefix: PromptPrefix) -> int:
        """How many of the prompt's leading blocks the index holds."""
        held = self._blocks
        matched = 0
        for block in prefix.blocks(self.block_size):
            if block not in held:
                break
            matched += 1
        return matched

    def predict(self, prefix: PromptPrefix, prompt_tokens: int) -> int:
        """The prompt tokens the engine would find cached: the matched blocks' tokens, never
        the prompt's last token."""
        if not self._blocks:
            return 0  # nothing held (or the index is off): no prompt need be hashed
        cached = self.matched_blocks(prefix) * prefix.tokens_per_block(self.block_size)
        return max(0, min(cached, prompt_tokens - 1))

    def sent(self, prefix: PromptPrefix) -> None:
        """The prompt was sent here: every full block of it is now (most recently) cached,
        its first the most recent, so its tail goes first."""
        self.sent_blocks(prefix.blocks(self.block_size))

    def sent_blocks(self, blocks: Sequence[int]) -> None:
        """``sent`` for a prompt's chained block hashes at this index's block size (another
        replica's dispatch here, sidecar.shared)."""
        if self.retained_blocks:  # else the index is off, or shrunk to nothing (settle)
            held = self._blocks
            for block in reversed(blocks):
                if block in held:
                    held.move_to_end(block)
                else:
                    held[block] = None
        self._evict()

    def settle(self, prefix: PromptPrefix, predicted_tokens: int,
               reported_tokens: int) -> None:
        """A request sent here ended, and the engine said it had found
        ``reported_tokens`` of its prompt cached where the index predicted
        ``predicted_tokens``. Blocks the index counted that the engine no longer held mean
        the engine keeps fewer blocks than the index does (its running requests hold the
        rest of its cache): the index shrinks by that many, least recently used first; a
        prediction met grows it back by a block, or by what the engine held beyond it. The
        prompt itself is cached now either way (the request computed what was missing)."""
        per_block = prefix.tokens_per_block(self.block_size)
        missed = (predicted_tokens - reported_tokens) // per_block
        if missed > 0:
            self.retained_blocks = max(0, min(len(self._blocks), self.retained_blocks)
                                       - missed)
        else:
            # Met: one block more, or as many as the engine held beyond the prediction.
            grown = max(1, (reported_tokens - predicted_tokens) // per_block)
            self.retained_blocks = min(self.capacity_blocks, self.retained_blocks + grown)
        self.sent(prefix)

    def _evict(self) -> None:
        held = self._blocks
        while len(held) > self.retained_blocks:
            held.popitem(last=False)
