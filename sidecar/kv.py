"""The KV cache our in-flight requests will hold on one backend, in blocks.

vLLM grows a sequence's KV one block at a time as it decodes and, when the cache runs out,
preempts running sequences and puts them back at the *front* of its waiting queue — ahead of
any other tenant's request that waits there (on a KV-tight engine a flood the engine could
not hold pushed the victim's first token from 50 ms to seconds, whatever the slot headroom:
docs/sidecar.md, "Admission defaults: learned from each engine"). Admission therefore counts
each in-flight request at the size it will reach: prompt + max(tokens generated so far,
expected output), in blocks of the engine's ``block_size``, the expected output being raised
as the answer grows to what its tenant's recent answers that long ended at
(``OutputEstimator.final``: decision 0018), so a long answer of a bimodal tenant is counted
at its long mode's size once it outgrows the short one, before the engine runs out. Keeping
that sum under the cache means the engine never has to preempt for our load; keeping an
over-share tenant's part under a lower watermark leaves room for the others
(``weighbridge.sidecar.core.SchedulingCore``).

A prompt's full blocks that the engine caches by prefix are one block however many requests
hold them: vLLM shares a cached block between the sequences whose prompts begin alike (a
system prompt, a conversation's history), so each in-flight request names its prompt's full
blocks (the chained hashes of ``sidecar.prefix``, where they are the engine's blocks) and a
named block counts once per backend, while any request holding it is in flight (per tenant:
once per tenant holding it).

That sum is what the watermark is judged on: it assumes every answer is at its final size at
once. A short request beside long ones is judged on less (``peak_with``): the most our requests
would hold at once during its own expected lifetime, every request decoding one token a step
per sequence and ending at its expected final output, so a classification that ends long
before the essays beside it reach their final size fits where they are held (decision 0018,
"The held head").

Invariants (tests/unit/sidecar/test_kv.py): ``blocks()`` is the number of distinct named
blocks held plus, over in-flight requests, ceil(footprint tokens / block_size) less the
request's named blocks, and per tenant likewise; a request's footprint never shrinks while it
is in flight; removing every request leaves zero.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    tenant: str
    prompt: int
    expected_output: int
    generated: int = 0
    blocks: int = 0  # of its own: beyond its named ones
    named: tuple[int, ...] = ()  # its prompt's full blocks, by hash, counted once a backend
    sequences: int = 1  # tokens it generates a step while it decodes

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
        self._holders: Counter[int] = Counter()  # named block -> in-flight requests holding it
        self._tenant_holders: Counter[tuple[str, int]] = Counter()
        self._curve: _Curve | None = None  # the lifetimes, sorted; None: changed since

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
            # Names at the old block size name no block at the new one: counted as its own.
            self._release(entry)
            entry.named = ()
            self._resize(entry)
        self._curve = None

    def add(self, request_id: str, tenant: str, prompt_tokens: int,
            expected_output_tokens: int, named_blocks: Sequence[int] = (),
            sequences: int = 1) -> None:
        """``named_blocks``: the hashes of the prompt's full blocks at this block size, where
        the engine shares them between requests (its prefix cache); at most the prompt's.
        ``expected_output_tokens`` is over all ``sequences``."""
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already counted")
        prompt = max(0, prompt_tokens)
        entry = _Entry(tenant, prompt, max(0, expected_output_tokens),
                       named=tuple(named_blocks[:prompt // self._block]),
                       sequences=max(1, sequences))
        self._curve = None
        self._entries[request_id] = entry
        holders, tenant_holders = self._holders, self._tenant_holders
        for block in entry.named:
            if not holders[block]:
                self._blocks += 1
            holders[block] += 1
            if not tenant_holders[(tenant, block)]:
                self._tenant_blocks[tenant] += 1
            tenant_holders[(tenant, block)] += 1
        self._resize(entry)

    def on_tokens(self, request_id: str, tokens: int,
                  expected_final: int | None = None) -> None:
        """``tokens`` more output tokens of the request came back (its footprint grows once
        they pass the expected output). ``expected_final``: the output it is now expected to
        end at, given what it has generated (``OutputEstimator.final``); it raises the
        expected output, never lowers it."""
        entry = self._entries.get(request_id)
        if entry is None or tokens <= 0:
            return
        entry.generated += tokens
        self._curve = None
        if expected_final is not None and expected_final > entry.expected_output:
            entry.expected_output = expected_final
        self._resize(entry)

    def remove(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self._curve = None
        self._release(entry)
        self._blocks -= entry.blocks
        self._untenant(entry.tenant, entry.blocks)

    def _release(self, entry: _Entry) -> None:
        """The entry's named blocks no longer held by it (the last holder frees each)."""
        holders, tenant_holders = self._holders, self._tenant_holders
        for block in entry.named:
            holders[block] -= 1
            if not holders[block]:
                del holders[block]
                self._blocks -= 1
            key = (entry.tenant, block)
            tenant_holders[key] -= 1
            if not tenant_holders[key]:
                del tenant_holders[key]
                self._untenant(entry.tenant, 1)

    def _untenant(self, tenant: str, blocks: int) -> None:
        if blocks <= 0:
            return
        left = self._tenant_blocks[tenant] - blocks
        if left > 0:
            self._tenant_blocks[tenant] = left
        else:
            del self._tenant_blocks[tenant]

    def blocks(self) -> int:
        return self._blocks

    def tenant_blocks(self, tenant: str) -> int:
        return self._tenant_blocks.get(tenant, 0)

    def blocks_of(self, prompt_tokens: int, expected_output_tokens: int) -> int:
        """What a request of that size would hold at its largest."""
        return -(-(max(0, prompt_tokens) + max(0, expected_output_tokens)) // self._block)

    def peak_with(self, prompt_tokens: int, expected_output_tokens: int,
                  sequences: int = 1) -> int:
        """The most blocks our in-flight requests and a new one of that size would hold at
        once while the new one runs: every request decodes ``sequences`` tokens a step from
        what it holds now and ends at its expected final output (its own blocks, rounded up
        as a sum: at most one block more per request than the engine's rounding), the named
        blocks held throughout. An upper bound on what the engine would need if the
        estimates hold and nothing else is admitted; ``blocks()`` bounds it from above."""
        curve = self._curve
        if curve is None:
            curve = self._curve = _Curve(self._entries.values(), len(self._holders))
        n = max(1, sequences)
        prompt = max(0, prompt_tokens)
        steps = -(-max(0, expected_output_tokens) // n)
        return curve.peak_with(prompt, steps, n, self._block)

    def mean_steps_left(self) -> float:
        """The in-flight requests' mean steps to their expected final output (0: none)."""
        curve = self._curve
        if curve is None:
            curve = self._curve = _Curve(self._entries.values(), len(self._holders))
        return curve.mean_steps

    def __len__(self) -> int:
        return len(self._entries)

    def _resize(self, entry: _Entry) -> None:
        blocks = -(-entry.tokens // self._block) - len(entry.named)
        delta = blocks - entry.blocks
        if delta:
            entry.blocks = blocks
            self._blocks += delta
            self._tenant_blocks[entry.tenant] += delta


class _Curve:
    """The in-flight requests' lifetimes from now, by steps to go, longest first, with
    prefix sums: the footprint ``s`` steps on is that of the requests with at least ``s`` to
    go, so its maxima over an interval fall where a request ends or the interval does."""

    __slots__ = ("_named", "_neg_steps", "_now", "_own_named", "_rate", "mean_steps")

    def __init__(self, entries: Iterable[_Entry], named: int) -> None:
        rows = sorted(
            ((max(e.generated, e.expected_output) - e.generated) // e.sequences,
             e.prompt + e.generated, e.sequences, len(e.named))
            for e in entries
        )
        rows.reverse()
        self._named = named
        self._neg_steps = [-r[0] for r in rows]  # ascending, for bisect
        self.mean_steps = -sum(self._neg_steps) / len(rows) if rows else 0.0
        self._now: list[int] = [0]  # tokens held now by the first k rows
        self._rate: list[int] = [0]  # tokens a step they add
        self._own_named: list[int] = [0]  # their named blocks (counted in ``_named``)
        for _, tokens, rate, own_named in rows:
            self._now.append(self._now[-1] + tokens)
            self._rate.append(self._rate[-1] + rate)
            self._own_named.append(self._own_named[-1] + own_named)

    def _at(self, alive: int, step: int, block: int) -> int:
        if not alive:
            return self._named
        tokens = self._now[alive] + self._rate[alive] * step
        return self._named + -(-tokens // block) + alive - 1 - self._own_named[alive]

    def peak_with(self, prompt: int, steps: int, rate: int, block: int) -> int:
        neg = self._neg_steps
        # Rows with at least ``steps`` to go are alive through the new request's whole life.
        last = bisect.bisect_right(neg, -steps)
        peak = self._at(last, steps, block) + -(-(prompt + rate * steps) // block)
        # The others end within it: each is at its largest at its last step.
        for alive in range(last + 1, len(neg) + 1):
            step = -neg[alive - 1]
            value = self._at(alive, step, block) + -(-(prompt + rate * step) // block)
            if value > peak:
                peak = value
        return peak
