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
