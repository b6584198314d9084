"""Which prompt prefixes each backend's prefix cache holds, as far as the sidecar can tell.

vLLM caches a prompt's KV in full blocks of ``block_size`` tokens, each named by a hash
chained over every token before it, and a new request reuses its longest run of cached
blocks from the start, but never its last token (vLLM always computes at least one). The
sidecar sees the prompts it sends, so it keeps, per backend, the chained hashes of the
blocks it sent there and predicts what a new prompt would find cached:

- a token-id prompt, or a text prompt the served model's tokenizer counted
  (sidecar.tokenizer), is cut exactly as the engine cuts it, at the engine's block size;
- any other text prompt is cut into blocks of ``TEXT_BLOCK_BYTES`` bytes of its UTF-8, and
  its matched bytes are worth the whole engine blocks they make at the backend's bytes per
  token (``TokenRate``), learned from the prompt tokens its answers report (4 until then,
  the estimate ``sidecar.prompt`` prices text with).

Each backend's index is bounded by the engine's KV cache in blocks
(``vllm:cache_config_info``) and forgets the least recently used block first, a prompt's
last block before its first (as vLLM frees a request's blocks tail first into its free-block
queue). What the engine reports (a request's ``usage.prompt_tokens_details.cached_tokens``)
corrects the bound: the engine keeps fewer blocks than its whole cache while requests run,
so a prediction the engine did not meet shrinks the index to what it retains. A text
prompt's prediction is an estimate (one prompt's bytes per token strays from its backend's
mean), so it misses only by more than ``TEXT_SLACK`` of itself and a block: a miss within
that is the estimate's, not an eviction. The index is a pure, clock-free core: the caller
says when a block was used by the order of its calls.

The engine's own counters bound it too. vLLM counts, in ``vllm:prefix_cache_queries``, the
prompt tokens of every request it admits from its waiting queue, whoever sent it: once per
request (a lookup that found no room is not counted; a preempted request's lookup on its
return goes to a series vLLM does not export). The sidecar counts the prompt tokens it sends
each backend (times the answers ``n``: each is an engine request; the replicas sharing its
state tell it theirs), and ``CacheShare`` compares the two over a window. When the engine
looks up more than the fleet sent, other clients share its cache, and as vLLM's cache keeps
blocks in the order requests last used them, the fleet's prompts hold about their share of
the lookups: the index then holds at most that share of the engine's blocks
(``bound_share``). A prompt counts as pending from its dispatch to its first token, as the
engine admits it in between, so the sidecar's own traffic alone never reads as less than
the whole cache.

Block hashes are ints made of ints only, so every process names a block alike: replicas
sharing their state tell each other the blocks they sent where (sidecar.shared), and each
index learns the others' dispatches as its own.

Invariants (``tests/unit/sidecar/test_prefix.py``): an index never holds more than its
capacity; a prediction never exceeds the prompt less one token and counts leading blocks
only (a hit is a prefix); a prompt just sent or settled is predicted whole, but for its last
token; a prediction the engine missed shrinks the index, one it met grows it back, never
past its share of the engine's cache; a text prediction is whole engine blocks of the
matched bytes at the learned rate, and the rate stays within [``RATE_MIN``, ``RATE_MAX``].
``CacheShare``
(``tests/unit/sidecar/test_prefix_share.py``): the share stays within [``SHARE_FLOOR``, 1],
is exactly 1 while the engine serves only what the sidecar sent, whenever it admits and
answers it, and follows the sidecar's part of the engine's lookups when others send too.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weighbridge.endpoints import EndpointKind
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN, content_text

TEXT_BLOCK_BYTES = 64  # 16 tokens at the prior rate: vLLM's default block size
# A text block read as eight 64-bit words (as fast as hashing its bytes: 42 against 37 us a
# 4 KB prompt, where one big int of it took 69).
_TEXT_BLOCK_WORDS = struct.Struct(f"<{TEXT_BLOCK_BYTES // 8}Q")
_ROOT = 0x5EED  # the chain's start, so an empty prefix hashes to no block's value
# TokenRate: a backend's bytes per prompt token start at the estimate's, worth this many
# tokens of evidence, and follow about the last RATE_WINDOW_TOKENS prompt tokens answered;
# the bounds keep a hostile prompt (a long run of one character, or of emoji) from setting
# every other tenant's predictions far off.
RATE_PRIOR_TOKENS = 1024
RATE_WINDOW_TOKENS = 65536
RATE_MIN, RATE_MAX = 1.0, 32.0
# A text prediction missed by less than this share of itself (and a block) is the estimate's
# error, not the engine's eviction: vllm bench's random prefixes of 768 tokens decode to 4.31
# to 4.71 bytes a token on one tokenizer, +-5% around their mean.
TEXT_SLACK = 0.125
# CacheShare: the least share of an engine's cache the index assumes its prompts hold; the
# window the engine's lookups and the sidecar's are compared over (an exponential one, in
# seconds); and the engine's lookups, in tokens, in the window before the share moves (fewer
# are a request or two, which a scrape can catch admitted before the sidecar's count).
# The share is the highest of the last ``SHARE_HOLD_S`` seconds' estimates: a prompt counted
# late (another replica's, told a sync later) lowers one scrape's estimate, not the share;
# others' traffic lowers every estimate, and the share after ``SHARE_HOLD_S``.
SHARE_FLOOR = 0.05
SHARE_WINDOW_S = 30.0
SHARE_MIN_TOKENS = 4096
SHARE_HOLD_S = 5.0
ADMITTED_HELD = 1024  # prompts admitted and not yet scraped, kept apart (then merged)


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
    def of(cls, kind: EndpointKind, body: dict[str, Any]) -> PromptPrefix | None:
        """The prompt of a body ``sidecar.prompt`` has validated: a completion's token ids
        or text, a chat's messages as role and text in order; None for a batch of prompts
        and for the pooling kinds (one engine request per input)."""
        if kind is EndpointKind.CHAT:
            return cls(messages=body["messages"])
        if kind is not EndpointKind.COMPLETIONS:
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
        """Prompt tokens one of its blocks is worth at the prior rate: ``block_size`` when
        its blocks are the engine's (token ids)."""
        return block_size if self.exact else TEXT_BLOCK_BYTES // BYTES_PER_TOKEN

    def utf8(self) -> bytes:
        """The text the blocks of a text prompt are cut from: a completion's prompt, or a
        chat's messages as role and text in order; empty for token ids."""
        if self.text is None and self.messages is not None:
            self.text = "".join(f"{m.get('role')}\x00{content_text(m.get('content'), '')}\x00"
                                for m in self.messages).encode()
        return self.text or b""

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
        else:
            text = self.utf8()
            words = _TEXT_BLOCK_WORDS.unpack_from
            # Hashed as ints, not as bytes: str and bytes hashes differ between processes
            # (PYTHONHASHSEED), ints' do not, so replicas name a block alike (sidecar.shared).
            for start in range(0, len(text) - TEXT_BLOCK_BYTES + 1, TEXT_BLOCK_BYTES):
                parent = hash((parent, *words(text, start)))
                hashes.append(parent)
        return tuple(hashes)


class TokenRate:
    """A backend's UTF-8 bytes per prompt token, learned from its answers: the text of each
    prompt the sidecar could not count exactly against the prompt tokens the engine
    reported for it, summed over an exponential window of about ``window_tokens`` tokens
    and begun at ``prior`` bytes a token, worth ``prior_tokens`` of them. Pure."""

    def __init__(self, prior: float = BYTES_PER_TOKEN, prior_tokens: float = RATE_PRIOR_TOKENS,
                 window_tokens: float = RATE_WINDOW_TOKENS) -> None:
        if not RATE_MIN <= prior <= RATE_MAX or prior_tokens <= 0 or window_tokens <= 0:
            raise ValueError("prior must be within the rate's bounds, prior_tokens and "
                             "window_tokens positive")
        self.window_tokens = window_tokens
        self._bytes = prior * prior_tokens
        self._tokens = float(prior_tokens)

    @property
    def bytes_per_token(self) -> float:
        return min(RATE_MAX, max(RATE_MIN, self._bytes / self._tokens))

    def observe(self, text_bytes: int, tokens: int) -> None:
        """A prompt of ``text_bytes`` bytes counted ``tokens`` tokens by the engine."""
        if text_bytes <= 0 or tokens <= 0:
            return
        kept = math.exp(-tokens / self.window_tokens)
        self._bytes = self._bytes * kept + text_bytes
        self._tokens = self._tokens * kept + tokens


class PrefixIndex:
    """One backend's cached blocks as the sidecar predicts them: an LRU set of chained
    block hashes, at most ``capacity_blocks`` of them (0: the engine's cache is not known
    yet, and nothing is predicted cached), and the backend's bytes per token for the text
    it cannot count exactly (``rate``)."""

    def __init__(self, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError("capacity_blocks must be at least 0 and block_size at least 1")
        self.capacity_blocks = capacity_blocks
        # The share of the engine's cache the sidecar's prompts hold (``bound_share``).
        self.share = 1.0
        # What the engine is learned to keep (``settle``): at most that share of its cache.
        self.retained_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # The prompts sent to this engine against its lookups (``observe_engine``).
        self.cache_share = CacheShare()
        self.rate = TokenRate()

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
            self.retained_blocks = self.ceiling_blocks
        self._evict()

    @property
    def ceiling_blocks(self) -> int:
        """The most the index may hold: its share of the engine's cache (at least a block of
        a known cache)."""
        if self.share >= 1.0 or not self.capacity_blocks:
            return self.capacity_blocks
        return max(1, int(self.share * self.capacity_blocks))

    def bound_share(self, share: float) -> None:
        """The sidecar's prompts hold ``share`` (0-1] of the engine's cache: the index holds
        at most that much of it. Where the share was what bound it, the index follows the
        share back up; where a missed prediction had shrunk it further (``settle``), it stays."""
        bound = self.ceiling_blocks
        self.share = min(1.0, max(0.0, share))
        if self.retained_blocks >= bound:
            self.retained_blocks = self.ceiling_blocks
        else:
            self.retained_blocks = min(self.retained_blocks, self.ceiling_blocks)
        self._evict()

    def observe_engine(self, at_s: float, queries_total: float,
                       hits_total: float | None = None) -> None:
        """A scrape of the engine, sent at ``at_s``, read its prefix-cache counters
        (``vllm:prefix_cache_queries_total`` and ``_hits_total``): the index is bounded by the
        share of the engine's lookups the sidecar had it make (``cache_share``, which the
        caller tells of prompts sent and admitted)."""
        self.bound_share(self.cache_share.observe(at_s, queries_total, hits_total))

    def snapshot(self, reported: bool = True) -> dict[str, int | float | bool | None]:
        """What /admin/state shows of the index; ``reported``: the engine's answers say what
        they found cached (the index is off without)."""
        return {"blocks": len(self._blocks), "retained_blocks": self.retained_blocks,
                "capacity_blocks": self.capacity_blocks, "block_size": self.block_size,
                "reported": reported, "share": round(self.share, 4),
                "engine_hit_rate": self.cache_share.hit_rate,
                "bytes_per_token": round(self.rate.bytes_per_token, 3)}

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
        """The prompt tokens the engine would find cached: the matched blocks' tokens (a
        text prompt's: the whole engine blocks its matched bytes make at ``rate``), never
        the prompt's last token."""
        if not self._blocks:
            return 0  # nothing held (or the index is off): no prompt need be hashed
        matched = self.matched_blocks(prefix)
        if prefix.exact:
            cached = matched * self.block_size
        else:
            tokens = matched * TEXT_BLOCK_BYTES / self.rate.bytes_per_token
            cached = int(tokens // self.block_size) * self.block_size
        return max(0, min(cached, prompt_tokens - 1))

    def _tokens_per_block(self, prefix: PromptPrefix) -> float:
        """Prompt tokens one of the index's blocks of ``prefix`` is worth."""
        if prefix.exact:
            return self.block_size
        return TEXT_BLOCK_BYTES / self.rate.bytes_per_token

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

    def settle(self, prefix: PromptPrefix, predicted_tokens: int, reported_tokens: int,
               prompt_tokens: int | None = None) -> None:
        """A request sent here ended, and the engine said it had found
        ``reported_tokens`` of its prompt cached where the index predicted
        ``predicted_tokens``, and counted ``prompt_tokens`` in it (None: not said). Blocks
        the index counted that the engine no longer held mean the engine keeps fewer blocks
        than the index does (its running requests hold the rest of its cache): the index
        shrinks by that many, least recently used first; a prediction met grows it back by a
        block, or by what the engine held beyond it. A text prompt teaches the backend's
        bytes per token, and its prediction misses only by more than ``TEXT_SLACK`` of itself
        and a block. The prompt itself is cached now either way (the request computed what was
        missing)."""
        missed_tokens = predicted_tokens - reported_tokens
        if not prefix.exact:
            if prompt_tokens is not None:
                self.rate.observe(len(prefix.utf8()), prompt_tokens)
            if missed_tokens <= self.block_size + TEXT_SLACK * predicted_tokens:
                missed_tokens = min(missed_tokens, 0)  # the estimate's error: met
        per_block = self._tokens_per_block(prefix)
        missed = int(missed_tokens // per_block)
        if missed > 0:
            self.retained_blocks = max(0, min(len(self._blocks), self.retained_blocks)
                                       - missed)
        else:
            # Met: one block more, or as many as the engine held beyond the prediction.
            grown = max(1, int((reported_tokens - predicted_tokens) // per_block))
            self.retained_blocks = min(self.ceiling_blocks, self.retained_blocks + grown)
        self.sent(prefix)

    def _evict(self) -> None:
        held = self._blocks
        while len(held) > self.retained_blocks:
            held.popitem(last=False)


class CacheShare:
    """The share of one engine's prefix cache the sidecar's prompts hold: the engine's lookups
    (``vllm:prefix_cache_queries_total``, prompt tokens) against the prompt tokens the
    sidecar had it look up, both summed over an exponential window of ``window_s`` seconds.
    Pure: every time is a parameter, on one monotonic clock (the scrapes' ``at_s`` and the
    sidecar's ``now``).

    vLLM counts a request's lookup when it admits the request, some time between the
    sidecar's dispatch and the first token. So the sidecar counts a prompt as *pending* from
    its dispatch (``sent``) and as *admitted* from its first token (``admitted``: its
    admission is behind it then), and a scrape taken at ``at_s`` (``observe``) moves into the
    window the prompts admitted by ``at_s``, which the engine's counter then holds too. Each
    prompt thus enters the sidecar's sum no earlier than the engine's, and the prompts still
    pending count whole: with only the sidecar's traffic the share is exactly 1, and other
    clients' lookups, which the sidecar never sees, lower it to the sidecar's part.

    The share is bounded to [``floor``, 1], moves only once the window holds ``min_tokens``
    of the engine's lookups, and is the highest estimate of the last ``hold_s`` seconds, so a
    prompt counted late (another replica's, told at its next sync) does not lower it. A
    counter that went back (the engine restarted) counts from 0 again. ``hit_rate``: the
    engine's hits over its lookups in the window (every client's), beside what the sidecar
    predicted for its own requests."""

    def __init__(self, window_s: float = SHARE_WINDOW_S, floor: float = SHARE_FLOOR,
                 min_tokens: float = SHARE_MIN_TOKENS, hold_s: float = SHARE_HOLD_S) -> None:
        if window_s <= 0 or not 0 < floor <= 1 or min_tokens < 0 or hold_s < 0:
            raise ValueError("window_s must be positive, floor in (0, 1], min_tokens and "
                             "hold_s at least 0")
        self.window_s = window_s
        self.floor = floor
        self.min_tokens = min_tokens
        self.hold_s = hold_s
        self._estimates: deque[tuple[float, float]] = deque()  # (at_s, estimate), held
        self.share = 1.0
        self.engine_tokens = 0.0  # the engine's lookups in the window
        self.sent_tokens = 0.0  # the sidecar's prompts admitted in the window
        self.hit_tokens = 0.0  # the engine's hits in the window
        self.pending_tokens = 0  # sent, not yet admitted
        # Admitted (or corrected) since the last scrape, in time order: (at, tokens).
        self._admitted: deque[tuple[float, int]] = deque()
        # (at_s, the engine's lookups, its hits) last observed.
        self._last: tuple[float, float, float | None] | None = None

    @property
    def hit_rate(self) -> float | None:
        if self.engine_tokens < self.min_tokens or self.engine_tokens <= 0:
            return None
        return round(min(1.0, self.hit_tokens / self.engine_tokens), 4)

    def sent(self, tokens: int) -> None:
        """Prompt tokens dispatched to the engine (negative: a dispatch that never reached
        it)."""
        self.pending_tokens += tokens

    def admitted(self, tokens: int, now: float, pending: int | None = None) -> None:
        """``tokens`` prompt tokens the engine has admitted by ``now`` (a first token came
        back, or the request ended without one), of ``pending`` sent (by default as many:
        a correction from the engine's own count of the prompt is ``pending=0``)."""
        self.pending_tokens -= tokens if pending is None else pending
        queue = self._admitted
        queue.append((now, tokens))
        if len(queue) > ADMITTED_HELD:
            # No scrape reads them (an engine without the counters): the two oldest become
            # one, at the later time (a prompt counted later only errs toward the sidecar).
            _, first = queue.popleft()
            at, second = queue.popleft()
            queue.appendleft((at, first + second))

    def observe(self, at_s: float, engine_queries: float,
                engine_hits: float | None = None) -> float:
        """The engine's counters as a scrape sent at ``at_s`` read them (cumulative): the
        share now. A scrape no later than the last is ignored."""
        last = self._last
        if last is not None and at_s <= last[0]:
            return self.share
        admitted, queue = 0, self._admitted
        while queue and queue[0][0] <= at_s:
            admitted += queue.popleft()[1]
        self._last = (at_s, engine_queries, engine_hits)
        if last is None:
            self._estimates.append((at_s, self.share))  # held as the first estimate
            return self.share  # the engine's history is not the window's
        # A counter that went back started from 0 (the engine restarted).
        looked_up = engine_queries - last[1] if engine_queries >= last[1] else engine_queries
        hits = 0.0
        if engine_hits is not None and last[2] is not None:
            hits = engine_hits - last[2] if engine_hits >= last[2] else engine_hits
        decay = math.exp(-(at_s - last[0]) / self.window_s)
        self.engine_tokens = self.engine_tokens * decay + looked_up
        self.sent_tokens = self.sent_tokens * decay + admitted
        self.hit_tokens = self.hit_tokens * decay + hits
        if self.engine_tokens >= self.min_tokens and self.engine_tokens > 0:
            later = sum(tokens for _, tokens in queue)  # admitted after at_s: pending still
            ours = self.sent_tokens + max(0, self.pending_tokens) + later
            estimates = self._estimates
            estimates.append((at_s, min(1.0, max(self.floor, ours / self.engine_tokens))))
            while estimates[0][0] < at_s - self.hold_s:
                estimates.popleft()
            self.share = max(estimate for _, estimate in estimates)
        return self.share
