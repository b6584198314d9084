"""KvFootprint: the blocks our in-flight requests will hold at their largest."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.kv import KvFootprint


def test_a_request_counts_at_its_largest() -> None:
    kv = KvFootprint(32)
    kv.add("r1", "flood", 512, 192)
    assert kv.blocks() == 22 == kv.tenant_blocks("flood")
    kv.on_tokens("r1", 100)
    assert kv.blocks() == 22  # still within the expected output
    kv.on_tokens("r1", 150)  # 250 generated: past the estimate, the footprint grows
    assert kv.blocks() == math.ceil((512 + 250) / 32)
    kv.set_block_size(16)
    assert kv.blocks() == math.ceil((512 + 250) / 16)
    kv.remove("r1")
    assert kv.blocks() == 0 and kv.tenant_blocks("flood") == 0 and len(kv) == 0


OPS = st.lists(st.tuples(st.sampled_from(["add", "tokens", "remove", "block"]),
                         st.integers(0, 9), st.sampled_from(["a", "b"]),
                         st.integers(0, 3000), st.integers(1, 64)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_blocks_are_the_sum_of_each_requests_blocks(ops) -> None:
    kv = KvFootprint(16)
    model: dict[str, tuple[str, int, int, int]] = {}
    for op, i, tenant, n, block in ops:
        rid = f"r{i}"
        if op == "add" and rid not in model:
            kv.add(rid, tenant, n, n // 3)
            model[rid] = (tenant, n, n // 3, 0)
        elif op == "tokens" and rid in model:
            before = kv.blocks()
            kv.on_tokens(rid, n % 200)
            t, p, e, g = model[rid]
            model[rid] = (t, p, e, g + n % 200)
            assert kv.blocks() >= before  # a footprint never shrinks in flight
        elif op == "remove":
            kv.remove(rid)
            model.pop(rid, None)
        elif op == "block":
            kv.set_block_size(block)

        def blocks(entry: tuple[str, int, int, int]) -> int:
            return -(-(entry[1] + max(entry[3], entry[2])) // kv.block_size)

        assert kv.blocks() == sum(blocks(e) for e in model.values())
        for who in ("a", "b"):
            assert kv.tenant_blocks(who) == sum(blocks(e) for e in model.values()
                                                if e[0] == who)


def test_a_shared_prefix_counts_once_while_any_holder_is_in_flight() -> None:
    kv = KvFootprint(16)
    system = tuple(range(10))  # ten full blocks every prompt begins with
    kv.add("r1", "a", 170, 30, system)  # 200 tokens: 13 blocks, ten of them named
    kv.add("r2", "a", 170, 30, system)
    kv.add("r3", "b", 170, 30, system)
    assert kv.blocks() == 10 + 3 * 3
    assert kv.tenant_blocks("a") == 10 + 2 * 3 and kv.tenant_blocks("b") == 10 + 3
    kv.remove("r1")
    kv.remove("r3")
    assert kv.blocks() == 10 + 3 == kv.tenant_blocks("a")  # r2 holds the prefix still
    kv.remove("r2")
    assert kv.blocks() == 0 and kv.tenant_blocks("a") == 0


SHARED_OPS = st.lists(st.tuples(st.sampled_from(["add", "tokens", "remove", "block"]),
                                st.integers(0, 9), st.sampled_from(["a", "b"]),
                                st.integers(0, 600), st.sampled_from([0, 1]),
                                st.sampled_from([8, 16, 32])), max_size=80)


@settings(max_examples=300, deadline=None)
@given(SHARED_OPS)
def test_named_blocks_count_once_and_the_rest_per_request(ops) -> None:
    kv = KvFootprint(16)
    # id -> (tenant, prompt, expected, generated, named)
    model: dict[str, tuple[str, int, int, int, tuple[int, ...]]] = {}
    for op, i, tenant, n, variant, block in ops:
        rid = f"r{i}"
        if op == "add" and rid not in model:
            # Prompts of one variant share their leading blocks (a chain of hashes).
            named = tuple(variant * 1000 + j for j in range(n // kv.block_size))
            kv.add(rid, tenant, n, n // 3, named)
            model[rid] = (tenant, n, n // 3, 0, named)
        elif op == "tokens" and rid in model:
            before = kv.blocks()
            kv.on_tokens(rid, n % 200)
            t, p, e, g, named = model[rid]
            model[rid] = (t, p, e, g + n % 200, named)
            assert kv.blocks() >= before  # a footprint never shrinks in flight
        elif op == "remove":
            kv.remove(rid)
            model.pop(rid, None)
        elif op == "block" and block != kv.block_size:
            kv.set_block_size(block)  # names at the old size name nothing: dropped
            model = {k: (*v[:4], ()) for k, v in model.items()}

        def own(entry: tuple[str, int, int, int, tuple[int, ...]]) -> int:
            return -(-(entry[1] + max(entry[3], entry[2])) // kv.block_size) - len(entry[4])

        entries = list(model.values())
        assert kv.blocks() == (len({b for e in entries for b in e[4]})
                               + sum(own(e) for e in entries))
        for who in ("a", "b"):
            mine = [e for e in entries if e[0] == who]
            assert kv.tenant_blocks(who) == (len({b for e in mine for b in e[4]})
                                             + sum(own(e) for e in mine))
    for rid in list(model):
        kv.remove(rid)
    assert kv.blocks() == 0 and kv.tenant_blocks("a") == 0 == kv.tenant_blocks("b")


def test_a_short_request_fits_beside_long_answers_that_grow_after_it_ends() -> None:
    kv = KvFootprint(16)
    for i in range(4):  # four answers 1,000 tokens from their final 3,200-token size
        kv.add(f"e{i}", "a", 200, 3000)
        kv.on_tokens(f"e{i}", 2000)
    assert kv.blocks() == 4 * 200
    # 13 blocks for 8 steps, while the four hold 2,208 tokens each: 4 * 138 + 13 + 3
    assert kv.peak_with(200, 8) == 4 * 138 + 13 + 3
    # One as long as they are is there when they are largest.
    assert kv.peak_with(200, 1000) == 4 * 200 + 75 + 3


LIVES = st.lists(st.tuples(st.integers(0, 900), st.integers(0, 400), st.integers(0, 500),
                           st.integers(1, 3), st.sampled_from([0, 1, 2])), max_size=12)


@settings(max_examples=300, deadline=None)
@given(LIVES, st.integers(0, 900), st.integers(0, 600), st.integers(1, 3),
       st.sampled_from([8, 16, 32]))
def test_peak_with_bounds_the_lockstep_footprint_from_above(lives, prompt, output, n,
                                                            block) -> None:
    """Every request decoding its sequences' tokens a step to its expected final: the most
    held at once during the new request's life is at most ``peak_with``, which is within
    one block a request of it (rounded as a sum) and never above ``blocks()`` plus the new
    request's largest and that rounding."""
    kv = KvFootprint(block)
    rows = []
    for i, (p, e, g, seqs, variant) in enumerate(lives):
        named = tuple(variant * 1000 + j for j in range(p // block)) if variant else ()
        kv.add(f"r{i}", "a", p, e, named, seqs)
        kv.on_tokens(f"r{i}", g)
        rows.append((p + g, (max(g, e) - g) // seqs, seqs, len(named)))
    distinct = len({b for i, (p, *_, v) in enumerate(lives) if v
                    for b in (v * 1000 + j for j in range(p // block))})
    steps = -(-output // n)
    exact = max(
        distinct + sum(-(-(c + rate * s) // block) - named
                       for c, left, rate, named in rows if left >= s)
        + -(-(prompt + n * s) // block)
        for s in range(steps + 1))
    peak = kv.peak_with(prompt, output, n)
    assert exact <= peak <= exact + max(0, len(rows) - 1)
    assert peak <= kv.blocks() + kv.blocks_of(prompt, n * steps) + max(0, len(rows) - 1)
