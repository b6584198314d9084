"""The KV cache our in-flight requests will hold on one backend, in blocks.

vLLM grows a sequence's KV one block at a time as it decodes and, when the cache runs out,
preempts running sequences and puts them back at the *front* of its waiting queue — ahead of
any other tenant's request that waits there (on a KV-tight engine a flood the engine could
not hold pushed the victim's first token from 50 ms to seconds, whatever the slot headroom:
docs/sidecar.md, "Admission defaults: learned from each engine"). Admission therefore counts
each in-flight request at the size it will reach: prompt + max(tokens generated so far,
expected output), in blocks of the engine's ``block_size``. Keeping that sum under the cache
means the engine never has to preempt for our load; keeping an over-share tenant's part
under a lower watermark leaves room for the others (``weighbridge.sidecar.core.SchedulingCore``).

Invariants (tests/unit/sidecar/test_kv.py): ``blocks()`` is the sum over in-flight requests
of ceil(footprint tokens / block_size), and per tenant likewise; a request's footprint never
shrinks while it is in flight; removing every request leaves zero.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    tenant: str
    prompt: int
    expected_output: int
    generated: int = 0
    blocks: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt + max(self.generated, self.expected_output)


class KvFootprint:
    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self._block = block_size
        self._entries: dict[str, _Entry] = {}
        self._blocks = 0
        self._tenant_blocks: Counter[str] = Counter()

    @property
    def block_size(self) -> int:
        return self._block

    def set_block_size(self, block_size: int) -> None:
        """The engine's block size became known (or changed with a restart): recount."""
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if block_size == self._block:
            return
        self._block = block_size
        for entry in self._entries.values():
            self._resize(entry)

    def add(self, request_id: str, tenant: str, prompt_tokens: int,
            expected_output_tokens: int) -> None:
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already counted")
        entry = _Entry(tenant, max(0, prompt_tokens), max(0, expected_output_tokens))
        self._entries[request_id] = entry
        self._resize(entry)

    def on_tokens(self, request_id: str, tokens: int) -> None:
        """``tokens`` more output tokens of the request came back (its footprint grows once
        they pass the expected output)."""
        entry = self._entries.get(request_id)
        if entry is None or tokens <= 0:
            return
        entry.generated += tokens
        self._resize(entry)

    def remove(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self._blocks -= entry.blocks
        left = self._tenant_blocks[entry.tenant] - entry.blocks
        if left > 0:
            self._tenant_blocks[entry.tenant] = left
        else:
            del self._tenant_blocks[entry.tenant]

    def blocks(self) -> int:
        return self._blocks

    def tenant_blocks(self, tenant: str) -> int:
        return self._tenant_blocks.get(tenant, 0)

    def blocks_of(self, prompt_tokens: int, expected_output_tokens: int) -> int:
        """What a request of that size would hold at its largest."""
        return -(-(max(0, prompt_tokens) + max(0, expected_output_tokens)) // self._block)

    def __len__(self) -> int:
        return len(self._entries)

    def _resize(self, entry: _Entry) -> None:
        blocks = -(-entry.tokens // self._block)
        delta = blocks - entry.blocks
        if delta:
            entry.blocks = blocks
            self._blocks += delta
            self._tenant_blocks[entry.tenant] += delta
