"""vLLM v1's KV block pool with automatic prefix caching, without tensors.

Pure and clock-free. What it models, as vLLM 0.32's ``KVCacheManager`` for one full-attention
group (vllm/v1/core/block_pool.py, kv_cache_utils.py, single_type_kv_cache_manager.py):

- **Block hashes**: a full block of ``block_size`` tokens is named by a hash chained over
  the prefix: its parent block's hash, its own token ids and its extra keys (the LoRA
  adapter; a per-request salt). Equal hashes mean equal prefixes, so a block can be shared.
- **The free queue**: every block that no request holds, in eviction order. It starts in
  block order; allocation pops from the front. A freed block that carries a hash is appended
  (it stays cached until it reaches the front: least recently freed first), one without a
  hash is put at the front (reused first). A request frees its blocks tail first, so the tail
  of a prefix is evicted before its head.
- **A hit**: the longest run of cached blocks from a request's first block, never reaching
  its last token (vLLM recomputes at least one token to get logits): at most
  ``(num_tokens - 1) // block_size`` blocks. Hit blocks are shared: their reference count
  goes up, and one that was free leaves the free queue (so it counts against the free
  blocks a request needs).
- **Caching**: a request's blocks are registered under their hashes when they are allocated
  for tokens that fill them (prompt or decode), before the step computes them, as vLLM does.

Invariants (tests/unit/test_emulator_prefix_cache.py): every block is either in the free
queue with no holder, or held by one or more requests, never both; a hash names only blocks
that carry it; the free queue plus the held blocks are all the blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["BlockHash", "BlockPool", "RequestBlocks", "hash_block"]

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: Sequence[int],
               extra_keys: tuple[Hashable, ...] | None = None) -> BlockHash:
    """The hash of a full block: chained over its parent's, its token ids and its extra
    keys (vLLM's ``hash_block_tokens``; a 128-bit digest, so distinct prefixes never meet)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(slots=True)
class RequestBlocks:
    """The blocks one request holds, in token order, and how many of the leading ones are
    registered under their hashes (vLLM's ``req_to_blocks`` and ``num_cached_block``)."""

    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens; with ``enable_caching`` full blocks
    are cached under their hashes and found again by later requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # An OrderedDict is vLLM's doubly linked free list: O(1) pop from the front, append,
        # prepend (move_to_end last=False) and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Several blocks may carry one hash (two requests filled equal blocks at once); the
        # first registered is the one a lookup returns, as vLLM's BlockHashToBlockMap.
        self._cached: dict[BlockHash, dict[int, None]] = {}

    # -- state ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted when needed)."""
        return len(self._free)

    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (the first is reused first)."""
        return list(self._free)

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._cached.values())

    # -- a request's life -------------------------------------------------------------------

    def longest_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """The cached blocks of the longest hit for a request of ``num_tokens`` tokens whose
        full blocks have ``block_hashes``: never its last token, none without caching."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for block_hash in block_hashes[:(num_tokens - 1) // self.block_size]:
            blocks = self._cached.get(block_hash)
            if not blocks:
                break
            hit.append(next(iter(blocks)))
        return hit

    def blocks_to_allocate(self, request: RequestBlocks, num_tokens: int,
                           hit: Sequence[int] = ()) -> int:
        """Free blocks that giving ``request`` slots for ``num_tokens`` tokens takes, with
        ``hit`` as its first blocks: the new ones, and the hit blocks now free (vLLM's
        ``get_num_blocks_to_allocate``)."""
        held = len(request.blocks) + len(hit)
        new = max(-(-num_tokens // self.block_size) - held, 0)
        return new + sum(1 for block in hit if self.ref_cnt[block] == 0)

    def allocate(self, request: RequestBlocks, num_tokens: int, hit: Sequence[int] = ()) -> None:
        """Give ``request`` (holding nothing when ``hit`` is given) its hit blocks and enough
        new ones for ``num_tokens`` tokens. The caller checked ``blocks_to_allocate``."""
        if hit:
            if request.blocks:
                raise ValueError("hit blocks are taken only by a request holding none")
            self._touch(hit)
            request.blocks.extend(hit)
            request.num_cached = len(hit)
        new = -(-num_tokens // self.block_size) - len(request.blocks)
        if new > 0:
            request.blocks.extend(self._new_blocks(new))

    def cache(self, request: RequestBlocks, block_hashes: Sequence[BlockHash],
              num_tokens: int) -> None:
        """Register the request's blocks that its first ``num_tokens`` tokens fill under
        their hashes (``block_hashes[i]`` names block i)."""
        if not self.enable_caching:
            return
        full = min(num_tokens // self.block_size, len(request.blocks))
        for i in range(request.num_cached, full):
            block, block_hash = request.blocks[i], block_hashes[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = block_hash
                self._cached.setdefault(block_hash, {})[block] = None
        request.num_cached = max(request.num_cached, full)

    def free(self, request: RequestBlocks) -> None:
        """Release the request's blocks, tail first (vLLM frees them reversed, so the tail of
        a prefix is evicted before its head)."""
        first: list[int] = []  # no hash: reused before anything cached
        last: list[int] = []  # cached: evicted in the order freed
        for block in reversed(request.blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                (last if self.block_hash[block] is not None else first).append(block)
        for block in reversed(first):
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        for block in last:
            self._free[block] = None
        request.blocks.clear()
        request.num_cached = 0

    # -- the pool ---------------------------------------------------------------------------

    def _touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def _new_blocks(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot take {n} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is None:
            return
        self.block_hash[block] = None
        holders = self._cached[block_hash]
        del holders[block]
        if not holders:
            del self._cached[block_hash]
