"""KV-aware admission in SchedulingCore: an over-share tenant's dispatches stop at the KV
watermark, the reserve above it stays for the others, and the engine's learned shape sizes
all of it; the derived slot headroom is work-conserving."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.test_core import arrive, balanced, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.vllm_metrics import BackendSample

ONE = [{"url": "http://127.0.0.1:8001", "name": "b1"}]
# 100 blocks of 16 tokens, 20 kept for under-share tenants: an over-share tenant's footprint
# stops at the watermark of 80.
KV = GateLimits(max_inflight=1000, kv_blocks=100, block_size=16, kv_reserve_blocks=20)


def flood(core: SchedulingCore, n: int, now: float = 0.0) -> None:
    for _ in range(n):
        # 220 + 100 expected output tokens = 20 blocks at their largest
        arrive(core, "a", now, prompt_tokens=220, max_tokens=100)


def test_a_flood_alone_stops_at_the_watermark_and_the_reserve_serves_the_others() -> None:
    core = SchedulingCore(make_config(backends=ONE), gate_limits=KV)
    flood(core, 10)
    sent = list(core.dispatch_ready(0.0))
    assert len(sent) == 4 and core.fleet["b1"].kv.blocks() == 80
    assert core.holds[("b1", "kv_headroom")] == 1
    arrive(core, "b", 0.1, prompt_tokens=60, max_tokens=4)  # 4 blocks
    (d,) = core.dispatch_ready(0.1)
    assert d.request.tenant == "b"  # no flood sequence had to finish first
    # A flood request that ends frees room for the next one.
    core.on_completed(sent[0].request, 220, 100, 0.2)
    (d,) = core.dispatch_ready(0.2)
    assert d.request.tenant == "a"
    assert core.fleet["b1"].kv.tenant_blocks("a") == 80


def test_at_the_watermark_a_short_request_passes_its_tenants_held_long_one() -> None:
    """Decision 0018, "The held head": the flood's next request, as large as those in flight,
    waits for room; a short one behind it, bounded by its ``max_tokens``, ends long before
    they reach their final size and goes; one without ``max_tokens`` has no such bound."""
    core = SchedulingCore(make_config(backends=ONE, scheduler={"ordering": "fifo"}),
                          gate_limits=KV)
    flood(core, 5)
    assert len(list(core.dispatch_ready(0.0))) == 4
    arrive(core, "a", 0.0, prompt_tokens=60, max_tokens=None, request_id="open")
    arrive(core, "a", 0.0, prompt_tokens=60, max_tokens=4, request_id="short")
    (d,) = core.dispatch_ready(0.1)
    assert d.request.id == "short" and core.fleet["b1"].kv.blocks() == 84
    assert core.holds[("b1", "kv_headroom")] == 2
    queued = [r.id for r in core.scheduler.queued_of("a")]
    assert "open" in queued and len(queued) == 2
    balanced(core)


def test_streamed_tokens_past_the_estimate_grow_the_footprint() -> None:
    core = SchedulingCore(make_config(backends=ONE), gate_limits=KV)
    flood(core, 10)
    sent = list(core.dispatch_ready(0.0))
    core.on_first_token(sent[0].request, 0.1)
    core.on_tokens_streamed(sent[0].request, 100, 0.1)
    assert core.fleet["b1"].kv.blocks() == 80
    core.on_completed(sent[1].request, 220, 100, 0.2)
    core.on_tokens_streamed(sent[0].request, 32, 0.2)  # 132 > 100 expected: +2 blocks
    core.fold_streamed()  # the footprint is a plain read: the stream's tokens folded first
    assert core.fleet["b1"].kv.blocks() == 62
    assert len(list(core.dispatch_ready(0.2))) == 1  # 62 + 20 = 82: then at the watermark


def test_kv_admission_is_off_for_the_fifo_baselines_and_without_a_known_cache() -> None:
    core = SchedulingCore(make_config("fcfs", backends=ONE), gate_limits=KV)
    flood(core, 10)
    assert len(list(core.dispatch_ready(0.0))) == 10
    core = SchedulingCore(make_config(backends=ONE),
                          gate_limits=GateLimits(max_inflight=1000))
    flood(core, 10)
    assert len(list(core.dispatch_ready(0.0))) == 10


def test_the_engines_cache_is_learned_from_its_metrics() -> None:
    config = make_config(backends=ONE, admission={"max_inflight_per_backend": 64,
                                                  "max_prefill_tokens_inflight": 0,
                                                  "max_backend_prefill_tokens": 0})
    core = SchedulingCore(config)
    core.on_backend_metrics("b1", BackendSample(0.0, 0, 0, 0.0, 0.0, 0.0, 0.0,
                                                kv_blocks=100, block_size=16))
    limits = core.fleet["b1"].gate.limits
    assert (limits.kv_blocks, limits.kv_reserve_blocks) == (100, 13)  # 1/8 of the cache
    flood(core, 10)
    assert len(list(core.dispatch_ready(0.1))) == 5  # 0, 20, 40, 60, 80 < 87


OPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["arrive", "burst"]), st.sampled_from(["a", "b", "i"]),
                  st.integers(0, 900)),
        st.tuples(st.just("dispatch"), st.just(""), st.just(0)),
        st.tuples(st.just("stream"), st.just(""), st.integers(0, 300)),
        st.tuples(st.sampled_from(["complete", "gone", "refused"]), st.just(""),
                  st.integers(0, 10**6)),
        st.tuples(st.just("scrape"), st.just(""), st.integers(0, 6)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["drr", "rr"]),
       ordering=st.sampled_from(["fifo", "shortest_prompt_first"]), ops=OPS)
def test_over_share_dispatches_pass_the_watermark_only_where_they_fit(policy, ordering,
                                                                     ops) -> None:
    limits = GateLimits(max_inflight=12, headroom_slots=4, kv_blocks=160, block_size=16,
                        kv_reserve_blocks=40)
    core = SchedulingCore(make_config(backends=ONE, scheduler={"policy": policy,
                                                               "ordering": ordering}),
                          gate_limits=limits)
    watermark = 120
    kv = core.fleet["b1"].kv
    inflight: list[QueuedRequest] = []
    now = 0.0
    for kind, who, value in ops:
        now += 0.01
        if kind == "arrive":
            # Long answers, short ones and unbounded ones.
            prompt, bound = (100 + value // 3, 300 + value // 2) if value % 3 else (
                16 + value % 64, 1 + value % 16)
            arrive(core, who, now, prompt_tokens=prompt,
                   max_tokens=None if value % 7 == 0 else bound)
        elif kind == "burst":  # long answers, then short requests behind them
            for i in range(8):
                arrive(core, who, now, prompt_tokens=100 + value // 3,
                       max_tokens=400 if i < 5 else 1 + (value + i) % 16)
        elif kind == "dispatch":
            while True:
                before = kv.blocks()
                share = {t: (kv.tenant_blocks(t), core.scheduler.share_fraction(t))
                         for t in ("a", "b", "i")}
                footprint = copy.deepcopy(kv)
                d = core.next_dispatch(now)
                if d is None:
                    break
                inflight.append(d.request)
                held, fraction = share[d.request.tenant]
                if before >= watermark and held >= fraction * watermark:
                    # Above the watermark only tenants under their share of it, and short
                    # requests that keep our footprint under it for their whole life.
                    bound = d.request.max_tokens
                    assert bound is not None and bound < footprint.mean_steps_left()
                    assert footprint.peak_with(d.request.prompt_tokens, bound) <= watermark
        elif kind == "stream" and inflight:
            req = inflight[value % len(inflight)]
            core.on_tokens_streamed(req, value % 40, now)
        elif kind in ("complete", "gone", "refused") and inflight:
            req = inflight.pop(value % len(inflight))
            if kind == "complete":
                core.on_completed(req, req.prompt_tokens, 10, now)
            elif kind == "gone":
                core.on_client_gone(req, req.prompt_tokens, 3, now)
            else:
                core.dispatch_failed(req, now)
        elif kind == "scrape":
            core.on_backend_metrics("b1", BackendSample(now, waiting=0, running=value))
    # Liveness: with nothing of ours in flight, a queued request always goes.
    for req in inflight:
        core.on_completed(req, req.prompt_tokens, 1, now)
    if core.scheduler.queued_requests:
        assert core.next_dispatch(now + 10) is not None
    assert kv.blocks() == 0 or core.fleet["b1"].gate.inflight > 0


def test_derived_headroom_is_kept_only_while_a_light_tenant_is_around() -> None:
    config = make_config(backends=ONE, admission={"max_running_per_backend": 16,
                                                  "max_prefill_tokens_inflight": 0,
                                                  "max_backend_prefill_tokens": 0,
                                                  "kv_aware": False})
    core = SchedulingCore(config)
    assert core.fleet["b1"].gate.limits.headroom_slots == 2  # 16 slots: a lone tenant holds 14
    core.on_backend_metrics("b1", BackendSample(0.0, waiting=0, running=0))
    for _ in range(20):
        arrive(core, "a", 0.0)
    # Nobody light around: the headroom is ordinary capacity (work-conserving).
    assert len(list(core.dispatch_ready(0.0))) == 16
    sent = [core.scheduler.dispatched(r) for r in list(core.scheduler._dispatched)]
    for req in sent[:3]:
        assert req is not None
        core.on_completed(req, 100, 10, 0.1)
    arrive(core, "b", 0.1)  # light: it arrived to an empty queue of its own
    got = [d.request.tenant for d in core.dispatch_ready(0.1)]
    # a, over its share, gets the free slots below the headroom only: b's stays free.
    assert sorted(got) == ["a", "b"]
    assert core.scheduler.tenant_inflight("a") == 14
    # Ten seconds after b was last seen light the headroom is ordinary capacity again.
    core.on_backend_metrics("b1", BackendSample(10.5, waiting=0, running=15))
    assert [d.request.tenant for d in core.dispatch_ready(10.5)] == ["a"]


def test_configured_headroom_is_always_kept() -> None:
    config = make_config(backends=ONE, admission={"max_running_per_backend": 16,
                                                  "headroom_slots": 2, "kv_aware": False})
    core = SchedulingCore(config)
    core.on_backend_metrics("b1", BackendSample(0.0, waiting=0, running=0))
    for _ in range(20):
        arrive(core, "a", 0.0)
    assert len(list(core.dispatch_ready(0.0))) == 14
