"""vLLM v1's prefix cache in the emulator: the block pool's invariants (hypothesis), the hit
rule, eviction order, and the step model that uses them (emulator/prefix_cache.py,
emulator/engine.py). The same cases against real vLLM are in tests/conformance."""

from __future__ import annotations

import copy
import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.stack import parse_stack
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel, simulate
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.prefix_cache import BlockPool, RequestBlocks, hash_block
from weighbridge.emulator.profiles import get_profile

BS = 4


def _hashes(tokens: list[int], block_size: int = BS) -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        out.append(hash_block(out[-1] if out else None, tokens[start:start + block_size]))
    return out


def _check_pool(pool: BlockPool, live: list[RequestBlocks]) -> None:
    """Every block is free with no holder or held with its holders counted, never both;
    a hash names only blocks that carry it."""
    holders = Counter(block for request in live for block in request.blocks)
    free = pool.free_queue()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert not set(free) & set(holders)
    assert set(free) | set(holders) == set(range(pool.num_blocks))
    for block in range(pool.num_blocks):
        assert pool.ref_cnt[block] == holders[block]
    cached = {b for blocks in pool._cached.values() for b in blocks}
    assert cached == {b for b in range(pool.num_blocks) if pool.block_hash[b] is not None}
    for block_hash, blocks in pool._cached.items():
        assert all(pool.block_hash[b] == block_hash for b in blocks)
    for request in live:
        assert len(request.blocks) == len(set(request.blocks))
        assert request.num_cached <= len(request.blocks)


# A request: its prompt drawn from a small alphabet of prefixes, so that hits happen.
prompts = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), prompts), min_size=1, max_size=40),
       num_blocks=st.integers(min_value=8, max_value=40))
def test_the_pool_keeps_its_invariants_through_any_lookups_allocations_and_frees(
        ops: list[tuple[bool, list[int]]], num_blocks: int) -> None:
    pool = BlockPool(num_blocks, BS)
    live: list[tuple[RequestBlocks, list[bytes]]] = []
    for release, tokens in ops:
        if release and live:
            request, _ = live.pop(0)
            pool.free(request)
        else:
            hashes = _hashes(tokens)
            hit = pool.longest_hit(hashes, len(tokens))
            # The hit never reaches the last token, and is a run from the first block.
            assert len(hit) * BS <= len(tokens) - 1
            assert all(pool.block_hash[b] == h for b, h in zip(hit, hashes, strict=False))
            request = RequestBlocks()
            if pool.blocks_to_allocate(request, len(tokens), hit) <= pool.num_free_blocks:
                pool.allocate(request, len(tokens), hit)
                pool.cache(request, hashes, len(tokens))
                live.append((request, hashes))
        _check_pool(pool, [r for r, _ in live])


def test_a_hit_is_the_longest_cached_run_of_full_blocks_short_of_the_last_token() -> None:
    pool = BlockPool(16, BS)
    first = RequestBlocks()
    tokens = list(range(10))  # two full blocks and a partial one
    pool.allocate(first, 10)
    pool.cache(first, _hashes(tokens), 10)
    assert len(pool.longest_hit(_hashes(tokens), 10)) == 2  # the partial block is not cached
    # A prompt of exactly two blocks hits only one: its last token is recomputed.
    assert len(pool.longest_hit(_hashes(tokens[:8]), 8)) == 1
    assert len(pool.longest_hit(_hashes(tokens[:9]), 9)) == 2
    # Shared to a point inside the second block: only the first.
    other = [*tokens[:6], 99, 98, 97, 96]
    assert len(pool.longest_hit(_hashes(other), 10)) == 1
    # A different first block breaks the chain, even with equal later blocks.
    assert pool.longest_hit(_hashes([42, *tokens[1:]]), 10) == []
    # An extra key (a LoRA adapter) makes the same tokens another prefix.
    lora = [hash_block(None, tokens[:4], (("lora", "sql"),))]
    assert pool.longest_hit(lora, 10) == []


def test_freed_blocks_stay_cached_and_are_evicted_oldest_first_tail_first() -> None:
    pool = BlockPool(8, BS)
    a, b = RequestBlocks(), RequestBlocks()
    ta, tb = list(range(100, 110)), list(range(200, 208))
    pool.allocate(a, 10)  # blocks 0, 1, 2 (2 is partial)
    pool.cache(a, _hashes(ta), 10)
    pool.allocate(b, 8)  # blocks 3, 4
    pool.cache(b, _hashes(tb), 8)
    pool.free(a)
    pool.free(b)
    # a's partial block (no hash) goes to the front; its cached ones after the never-used
    # ones, tail first; then b's, tail first.
    assert pool.free_queue() == [2, 5, 6, 7, 1, 0, 4, 3]
    assert len(pool.longest_hit(_hashes(ta), 10)) == 2
    # Five new blocks: the partial, the three never used, then a's tail.
    c = RequestBlocks()
    pool.allocate(c, 5 * BS)
    assert c.blocks == [2, 5, 6, 7, 1]
    assert len(pool.longest_hit(_hashes(ta), 10)) == 1  # a's head is still there
    assert len(pool.longest_hit(_hashes(tb), 9)) == 2  # b is untouched
    # A hit on a free block takes it out of the free queue (and counts as taken).
    d = RequestBlocks()
    hit = pool.longest_hit(_hashes(tb), 9)
    assert pool.blocks_to_allocate(d, 9, hit) == 3  # 1 new + 2 free hit blocks
    pool.allocate(d, 9, hit)
    assert pool.ref_cnt[4] == pool.ref_cnt[3] == 1 and 3 not in pool.free_queue()
    _check_pool(pool, [c, d])


def test_without_caching_nothing_is_found_and_freed_blocks_are_reused_first() -> None:
    pool = BlockPool(4, BS, enable_caching=False)
    a = RequestBlocks()
    tokens = list(range(8))
    pool.allocate(a, 8)
    pool.cache(a, _hashes(tokens), 8)
    pool.free(a)
    assert pool.longest_hit(_hashes(tokens), 9) == []
    assert pool.free_queue() == [1, 0, 2, 3]


# -- the step model ----------------------------------------------------------------------------

PROFILE = get_profile("cpu-tiny")


def _model(**overrides: object) -> StepModel:
    fields: dict[str, object] = {"max_num_seqs": 4, "max_num_batched_tokens": 512,
                                 "num_kv_blocks": 64, "block_size": 32, "max_model_len": 1024}
    fields.update(overrides)
    return StepModel(EngineConfig(**fields), PROFILE)  # type: ignore[arg-type]


def _ids(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((7 * i + 3 + offset) % 90 + 6 for i in range(n))


def _run(model: StepModel, *seqs: Sequence) -> list[Sequence]:
    """Each request alone, one after another (each ends before the next arrives)."""
    now = 0.0
    for seq in seqs:
        seq.arrival_s = now
        for result in simulate(model, [seq], start_s=now):
            now = result.end_s
    return list(seqs)


def _seq(rid: str, prompt: tuple[int, ...], out: int = 4, **kw: object) -> Sequence:
    return Sequence(rid, len(prompt), out, out, 0.0, prompt_ids=prompt, **kw)  # type: ignore[arg-type]


def test_the_issue_s_examples_repeat_and_a_prefix_shared_inside_a_block() -> None:
    model = _model()
    base = _ids(300)
    first, repeat, shared = _run(model, _seq("a", base), _seq("b", base),
                                 _seq("c", base[:200] + _ids(100, 1)))
    assert (first.num_cached_tokens, repeat.num_cached_tokens,
            shared.num_cached_tokens) == (0, 288, 192)
    assert (model.counters.prefix_cache_queries, model.counters.prefix_cache_hits) == (900, 480)
    # Prefill is charged for the computed tokens only: 300 - 288 in one step.
    assert first.num_cache_creation_tokens == 288 and repeat.num_cache_creation_tokens == 0


def test_a_hit_s_prefill_pays_its_attention_to_the_cached_prefix() -> None:
    """The step charges the computed tokens and, per chunk, new tokens x tokens before it:
    a repeat computes 12 tokens over its 288 cached ones; a prompt computed whole (or one
    chunk of it from the start) pays no context term."""
    profile = PROFILE.with_overrides(t_prefill_context=1e-6)
    model = StepModel(_model().config, profile)
    base = _ids(300)
    steps = []
    now = 0.0
    for seq in (_seq("a", base), _seq("b", base)):
        seq.arrival_s = now
        for result in simulate(model, [seq], start_s=now):
            steps.append(result.batch)
            now = result.end_s
    first, repeat = steps[0], steps[4]  # each request: one prefill step, then 3 decodes
    assert (first.prefill_tokens, first.prefill_context) == (300, 0)
    assert (repeat.prefill_tokens, repeat.prefill_context) == (12, 12 * 288)
    assert repeat.duration_s == profile.step_time(12, 0, 300, 12 * 288)
    # Chunked: the second chunk of a 300-token prompt under a 256-token budget attends to
    # the first chunk's 256.
    chunked = StepModel(_model(max_num_batched_tokens=256).config, profile)
    batches = [r.batch for r in simulate(chunked, [_seq("c", _ids(300, 5))])]
    assert [(b.prefill_tokens, b.prefill_context) for b in batches[:2]] == [(256, 0),
                                                                           (44, 44 * 256)]


def test_a_prompt_of_whole_blocks_repeated_recomputes_its_last_block() -> None:
    model = _model()
    prompt = _ids(256)
    _, again = _run(model, _seq("a", prompt), _seq("b", prompt))
    assert again.num_cached_tokens == 224  # (256 - 1) // 32 blocks


def test_decode_blocks_are_cached_and_a_follow_up_prompt_hits_them() -> None:
    """A turn that resends the previous prompt and answer hits the answer's full blocks."""
    model = _model()
    answer = 40
    first = _seq("a", _ids(50), out=answer, output_ids=lambda i: 1000 + i)
    follow = _seq("b", _ids(50) + tuple(1000 + i for i in range(answer)) + _ids(10, 7))
    _run(model, first, follow)
    # 90 tokens of the first request were known when it ended, 89 computed (its last
    # sampled token never is): blocks up to 64 are full and cached.
    assert follow.num_cached_tokens == 64


def test_a_lora_adapter_s_blocks_are_its_own() -> None:
    model = _model()
    prompt = _ids(100)
    _, other, same = _run(model, _seq("a", prompt, lora="sql"), _seq("b", prompt),
                          _seq("c", prompt, lora="sql"))
    assert (other.num_cached_tokens, same.num_cached_tokens) == (0, 96)


def test_requests_without_token_ids_share_nothing_but_hit_their_own_blocks_again() -> None:
    """A sequence without prompt ids is content of its own: never a hit on another's blocks;
    preempted, it finds its own blocks again; its re-query is not counted (vLLM counts
    only first admissions)."""
    model = _model(num_kv_blocks=40, max_num_seqs=2)
    a = Sequence("a", 600, 300, 300, 0.0)
    b = Sequence("b", 600, 300, 300, 0.0)
    results = list(simulate(model, [a, b]))
    assert model.counters.preemptions > 0
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert (model.counters.prefix_cache_queries, model.counters.prefix_cache_hits) == (1200, 0)
    preempted = a if a.num_preemptions else b
    recomputed = sum(r.batch.scheduled.get(preempted, 0) for r in results)
    # Its resumption computed fewer than all of its tokens again: it found its blocks.
    assert recomputed < preempted.prompt_tokens + preempted.output_tokens * 2


def test_without_prefix_caching_nothing_is_counted_or_found() -> None:
    model = _model(enable_prefix_caching=False)
    prompt = _ids(300)
    _, again = _run(model, _seq("a", prompt), _seq("b", prompt))
    assert again.num_cached_tokens == 0
    assert (model.counters.prefix_cache_queries, model.counters.prefix_cache_hits) == (0, 0)


requests = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=0.3),  # arrival
        st.integers(min_value=0, max_value=3),  # which shared prefix
        st.integers(min_value=0, max_value=150),  # its length
        st.integers(min_value=1, max_value=60),  # own tokens after it
        st.integers(min_value=1, max_value=60),  # output tokens
    ),
    min_size=1, max_size=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, block_size=st.sampled_from([1, 4, 16]),
       kv_tokens=st.integers(min_value=300, max_value=1500),
       chunked=st.booleans())
def test_under_any_load_hits_stay_below_the_prompt_and_the_pool_stays_consistent(
        reqs: list[tuple[float, int, int, int, int]], block_size: int, kv_tokens: int,
        chunked: bool) -> None:
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=64 if chunked else 300,
                          num_kv_blocks=math.ceil(kv_tokens / block_size),
                          block_size=block_size, max_model_len=300, chunked_prefill=chunked)
    model = StepModel(config, PROFILE)
    seqs = [Sequence(f"r{i}", p + own, out, out, at,
                     prompt_ids=_ids(p, 11 * prefix) + _ids(own, 1000 + i),
                     output_ids=lambda j, i=i: 5000 + 100 * i + j)
            for i, (at, prefix, p, own, out) in enumerate(reqs)]
    seqs = [s for s in seqs if s.prompt_tokens + s.max_tokens <= config.max_model_len]
    queries = 0
    for _ in simulate(model, seqs):
        live = [s.kv for s in model.running]
        _check_pool(model.kv, live)
    for seq in seqs:
        assert seq.is_finished
        assert 0 <= seq.num_cached_tokens <= seq.prompt_tokens - 1
        assert seq.num_cached_tokens % block_size == 0
        queries += seq.prompt_tokens
    assert model.counters.prefix_cache_queries == queries
    assert model.counters.prefix_cache_hits == sum(s.num_cached_tokens for s in seqs)
    assert model.free_blocks == config.num_kv_blocks


def test_coasting_leaves_the_pool_as_step_by_step_scheduling_does() -> None:
    """Which blocks decode steps take from the free queue, and which they cache, depend on
    the order of the allocations: coast() takes them in step order, as schedule() would."""
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=96, block_size=4, max_model_len=384)
    model = StepModel(config, PROFILE)
    # A cached prefix freed first (75 blocks at the end of the free queue, 21 never used
    # before them), so that the decode blocks evict it, in order.
    _run(model, _seq("warm", _ids(300), out=2))
    for i in range(3):
        model.add(_seq(f"r{i}", _ids(10 + 3 * i, 40 * i), out=30,
                       output_ids=lambda j, i=i: 7000 + 100 * i + j))
    now = 0.0
    batch = model.schedule(now)
    while batch is not None and batch.prefill_tokens:
        now += batch.duration_s
        model.complete(batch, now)
        batch = model.schedule(now)
    assert batch is not None
    end = now + batch.duration_s
    stepwise = copy.deepcopy((model, batch))
    coasted = model.coast(batch, end, math.inf)
    assert coasted is not None
    ends, _ = coasted
    ref_model, ref_batch = stepwise
    for at in ends:
        ref_model.complete(ref_batch, at)
        nxt = ref_model.schedule(at)
        assert nxt is not None
        ref_batch = nxt
    assert ref_model.kv.free_queue() == model.kv.free_queue()
    assert ref_model.kv._cached == model.kv._cached
    assert [s.kv for s in ref_model.running] == [s.kv for s in model.running]
    warm = [model.kv.is_cached(h) for h in _hashes(list(_ids(300)))]
    assert len(ends) > 20 and 0 < warm.count(True) < 75  # it evicted some, tail first
    assert warm == sorted(warm, reverse=True)


def test_stack_files_and_the_simulator_take_the_switch() -> None:
    spec = parse_stack({"sidecar": {"tenants": {"a": {"tier": "standard",
                                                      "api_keys": ["plain:k"]}}},
                        "engines": {"emulator": {"enable_prefix_caching": False}}})
    assert spec.engines.emulator.flags()["enable_prefix_caching"] is False
    assert not SimEngine("e", spec.engines.emulator).model.kv.enable_caching
    assert SimEngine("e", EmulatorOptions()).model.kv.enable_caching  # vLLM's default
