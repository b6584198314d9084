"""ShapeLearner: what an engine is, from consecutive scrapes; derive_limits: the defaults
derived from it, and the config overriding them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.admission import (
    DEFAULT_POLL_S,
    DEFAULT_STEP_BUDGET,
    POLL_BOUNDS_S,
    POLL_COST_CAP_S,
    POLL_SCRAPE_MULTIPLE,
    WAITING_UNKNOWN_SLOTS,
    AdmissionGate,
    GateLimits,
    derive_limits,
)
from weighbridge.sidecar.config import Admission
from weighbridge.sidecar.shape import SATURATED_WAIT_STEPS, SCRAPE_WINDOW, EngineShape, ShapeLearner
from weighbridge.vllm_metrics import BackendSample, parse_vllm_metrics


@dataclass(frozen=True)
class Scrape:
    at_s: float
    waiting: float
    running: float
    generation_tokens_total: float | None = None
    queue_time_sum: float | None = None
    queue_time_count: float | None = None
    kv_blocks: int | None = None
    block_size: int | None = None
    kv_cache_usage: float | None = None
    scrape_s: float | None = None


def test_cache_config_info_gives_the_kv_cache() -> None:
    shape = ShapeLearner().observe(Scrape(0.0, 0, 0, kv_blocks=572, block_size=32), 0.1)
    assert (shape.kv_blocks, shape.block_size) == (572, 32)


def test_the_real_exposition_format_is_read() -> None:
    text = "\n".join([
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 24.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0',
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",'
        'enable_prefix_caching="True",num_gpu_blocks="572",num_gpu_blocks_override="None"} 1.0',
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 4.5',
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 9.0',
    ])
    sample = parse_vllm_metrics(text, 1.0)
    assert (sample.kv_blocks, sample.block_size) == (572, 32)
    assert (sample.queue_time_sum, sample.queue_time_count) == (4.5, 9.0)
    assert sample.prefix_caching is True
    off = parse_vllm_metrics(text.replace('"True"', '"False"'), 1.0)
    assert off.prefix_caching is False
    bare = parse_vllm_metrics("\n".join(text.splitlines()[:3]), 1.0)
    assert bare.kv_blocks is None and bare.queue_time_count is None
    assert bare.prefix_caching is None


def test_a_momentary_queue_is_not_saturation() -> None:
    learner = ShapeLearner()
    # 40 running, a few arrivals caught between two steps of 10 ms; those that finished
    # had waited half a step on average.
    learner.observe(Scrape(0.0, 3, 40, 0, 0.0, 0), 0.1)
    shape = learner.observe(Scrape(0.1, 2, 41, 400, 0.5, 100), 0.1)
    assert shape.slots is None
    assert math.isclose(shape.step_s or 0, 0.1 / (400 / 40.5))


def test_a_queue_that_holds_requests_for_steps_is_saturation() -> None:
    learner = ShapeLearner()
    learner.observe(Scrape(0.0, 5, 32, 0, 0.0, 0), 0.1)
    step = 0.1 / 32  # 32 running, 32 tokens per 0.1 s each: 10 ms steps... per sequence
    shape = learner.observe(Scrape(0.1, 6, 32, 320, 10 * SATURATED_WAIT_STEPS * 0.01, 10), 0.1)
    assert shape.slots == 32
    del step
    # Later the engine ran more than that: it can.
    shape = learner.observe(Scrape(0.2, 0, 40, 640, 0.4, 10), 0.1)
    assert shape.slots == 40


def test_a_ramp_bound_by_the_prefill_budget_is_not_saturation() -> None:
    """Requests wait for several steps while the engine still admits more every step (long
    prompts, a small budget): the wait is for prefill budget, not slots. Once the running
    count stops growing with a queue still there, it is saturation."""
    learner = ShapeLearner()
    long_wait = 10 * SATURATED_WAIT_STEPS * 0.01
    learner.observe(Scrape(0.0, 20, 10, 0, 0.0, 0), 0.1)
    for i, running in enumerate([20, 30, 40, 50], start=1):
        shape = learner.observe(Scrape(0.1 * i, 20, running, 1000 * i, long_wait * i, i), 0.1)
        assert shape.slots is None, running
    shape = learner.observe(Scrape(0.5, 20, 50, 5000, long_wait * 5, 5), 0.1)
    assert shape.slots == 50 and shape.slots_exact


def test_an_engine_larger_than_the_cap_gets_its_slots_learned_at_the_cap() -> None:
    """An engine of 256 slots behind the fallback cap of 64 never queues, so saturation is
    never seen; the gate reports the cap binding with all of it running and nothing
    waiting, and from then on the engine is known to hold at least that many."""
    fallback = 64
    gate = AdmissionGate(GateLimits(max_inflight=fallback),
                         derive=lambda shape: derive_limits(Admission(), shape))
    for _ in range(fallback):
        gate.on_dispatched(0.0)
    assert gate.shape.slots is None
    gate.observe(BackendSample(0.1, 0, fallback, 0.1, 0))
    assert gate.shape.slots == fallback and not gate.shape.slots_exact
    # A lower bound: headroom kept for others, and a lone flood may probe a little past it.
    assert gate.limits.headroom_slots > 0
    assert fallback < gate.share_slots(0.1) < gate.cap(0.1)


def test_a_lower_bound_grows_to_a_larger_engine_and_becomes_exact_where_it_queues() -> None:
    """A lone flood behind the gate, on an engine of 256 slots: each scrape shows all it
    sent running, which raises the bound, until the engine is full; then the engine queues
    and the count becomes exact, with the full headroom below it."""
    engine_slots = 256
    gate = AdmissionGate(GateLimits(max_inflight=64),
                         derive=lambda shape: derive_limits(Admission(), shape))
    inflight, t, generated = 0, 0.0, 0.0
    queue_time = queue_count = 0.0
    rounds = 0
    while not gate.shape.slots_exact and rounds < 200:
        rounds += 1
        while gate.verdict(t).mode == "open":  # the lone flood takes every open place
            gate.on_dispatched(t)
            inflight += 1
        t += 0.1
        running, waiting = min(inflight, engine_slots), max(0, inflight - engine_slots)
        generated += running * 10  # 10 ms steps
        if waiting:  # what waits, waits for a slot turnover: many steps
            queue_time, queue_count = queue_time + 10.0, queue_count + 1
        gate.observe(Scrape(t, waiting, running, generated, queue_time, queue_count))
    # ~6% more a round (half the waiting bound, S/16): 64 to 256 in about two dozen scrapes.
    assert rounds < 40, rounds
    assert gate.shape.slots == engine_slots and gate.shape.slots_exact
    assert gate.share_slots(t) < engine_slots  # a lone tenant now leaves running slots free


def test_a_cap_that_binds_while_the_engine_queues_teaches_nothing_new() -> None:
    gate = AdmissionGate(GateLimits(max_inflight=8),
                         derive=lambda shape: derive_limits(Admission(), shape))
    for _ in range(8):
        gate.on_dispatched(0.0)
    gate.observe(BackendSample(0.1, 3, 5, 0.1, 0))  # 5 running, 3 of ours waiting
    assert gate.shape.slots is None


def test_runs_at_least_never_lowers_the_slots() -> None:
    learner = ShapeLearner()
    assert learner.runs_at_least(40).slots == 40
    assert learner.runs_at_least(32).slots == 40
    assert learner.runs_at_least(48).slots == 48


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 64), st.integers(0, 5),
                          st.floats(0, 2)), max_size=30))
def test_slots_never_decrease_and_bound_saturated_running(steps) -> None:
    learner = ShapeLearner()
    t, gen, qsum, qcount = 0.0, 0.0, 0.0, 0
    previous_slots = None
    for waiting, running, finished, wait in steps:
        t += 0.1
        gen += running
        qcount += finished
        qsum += finished * wait
        shape = learner.observe(Scrape(t, waiting, running, gen, qsum, qcount), 0.1)
        if previous_slots is not None:
            assert shape.slots is not None and shape.slots >= previous_slots
        if shape.slots is not None and previous_slots is not None and running > previous_slots:
            assert shape.slots >= running
        assert shape.step_s is None or shape.step_s > 0
        previous_slots = shape.slots


def test_nothing_learned_gives_the_unknown_engine_defaults() -> None:
    limits = derive_limits(Admission(), EngineShape())
    assert limits.max_backend_waiting == WAITING_UNKNOWN_SLOTS
    assert limits.max_running is None and limits.headroom_slots == 0
    assert limits.kv_blocks is None  # no KV-aware admission without a known cache
    assert limits.max_prefill_tokens_inflight == DEFAULT_STEP_BUDGET
    assert limits.max_backend_prefill_tokens == 2 * DEFAULT_STEP_BUDGET
    assert limits.poll_s == DEFAULT_POLL_S


def test_a_learned_engine_sizes_every_knob() -> None:
    shape = EngineShape(slots=32, slots_exact=True, kv_blocks=572, block_size=32, step_s=0.02)
    limits = derive_limits(Admission(), shape)
    assert limits.max_backend_waiting == 4
    assert limits.max_running == 36  # 32 running, 4 waiting
    # a lone tenant holds at most 32 - 4 = 28 in flight: 4 running slots stay free
    assert limits.max_running - limits.headroom_slots == 28
    assert limits.kv_blocks == 572 and limits.block_size == 32
    assert limits.kv_reserve_blocks == math.ceil(572 * 4 / 32)
    assert limits.poll_s == 0.16


def test_the_scrape_duration_is_the_median_of_the_recent_ones() -> None:
    learner = ShapeLearner()
    assert learner.observe(Scrape(0.0, 0, 0), 0.1).scrape_s is None  # untimed
    durations = [0.003] * (SCRAPE_WINDOW - 1) + [0.5]  # one scrape met a long step
    for i, d in enumerate(durations):
        shape = learner.observe(Scrape(1.0 + i, 0, 0, scrape_s=d), 0.1)
    assert shape.scrape_s == 0.003
    for i in range(SCRAPE_WINDOW):  # the engine's server got slower: the median follows
        shape = learner.observe(Scrape(100.0 + i, 0, 0, scrape_s=0.008), 0.1)
    assert shape.scrape_s == 0.008


@given(step_s=st.one_of(st.none(), st.floats(1e-4, 1.0)),
       scrape_s=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_scrapes_take_a_small_share_of_the_engine_server(step_s: float | None,
                                                         scrape_s: float | None) -> None:
    """The poll period is the step-derived one, raised to POLL_SCRAPE_MULTIPLE scrape
    durations (scrapes then take at most 1/50 of the engine server's time) up to
    POLL_COST_CAP_S, and never lowered by a fast scrape."""
    limits = derive_limits(Admission(), EngineShape(step_s=step_s, scrape_s=scrape_s))
    poll = limits.poll_s
    by_steps = derive_limits(Admission(), EngineShape(step_s=step_s)).poll_s
    assert by_steps == (DEFAULT_POLL_S if step_s is None
                        else min(max(8 * step_s, POLL_BOUNDS_S[0]), POLL_BOUNDS_S[1]))
    assert poll >= by_steps
    assert poll <= max(by_steps, POLL_COST_CAP_S)
    if scrape_s is not None and POLL_SCRAPE_MULTIPLE * scrape_s <= POLL_COST_CAP_S:
        assert poll >= POLL_SCRAPE_MULTIPLE * scrape_s
    assert limits.metrics_stale_s >= poll  # never judged stale between two polls


def test_a_configured_poll_period_is_kept_however_slow_the_scrapes() -> None:
    shape = EngineShape(step_s=0.005, scrape_s=0.02)
    assert derive_limits(Admission(metrics_poll_ms=50), shape).poll_s == 0.05
    assert derive_limits(Admission(), shape).poll_s == POLL_COST_CAP_S


def test_config_values_override_what_is_learned() -> None:
    shape = EngineShape(slots=32, slots_exact=True, kv_blocks=572, block_size=32, step_s=0.02)
    admission = Admission(max_running_per_backend=16, max_backend_waiting=1, headroom_slots=3,
                          kv_cache_blocks=100, kv_reserve_blocks=10, metrics_poll_ms=200,
                          step_budget_tokens=512, max_backend_prefill_tokens=0)
    limits = derive_limits(admission, shape)
    assert (limits.max_running, limits.max_backend_waiting, limits.headroom_slots) == (16, 1, 3)
    assert (limits.kv_blocks, limits.kv_reserve_blocks) == (100, 10)
    assert limits.poll_s == 0.2
    assert limits.max_prefill_tokens_inflight == 512
    assert limits.max_backend_prefill_tokens is None  # 0: off
    assert derive_limits(Admission(kv_aware=False), shape).kv_blocks is None


def test_fifo_baselines_get_no_derived_fairness_settings() -> None:
    shape = EngineShape(slots=32, slots_exact=True, kv_blocks=572, block_size=32)
    limits = derive_limits(Admission(), shape, tenant_aware=False)
    assert limits.headroom_slots == 0 and limits.kv_blocks is None
    assert limits.max_prefill_tokens_inflight is None
    assert limits.max_backend_prefill_tokens is None
    assert limits.max_running == 36  # the engine's size is no fairness setting


@settings(max_examples=300, deadline=None)
@given(slots=st.one_of(st.none(), st.integers(1, 4096)),
       kv=st.one_of(st.none(), st.integers(1, 10**6)),
       fallback=st.integers(1, 512), waiting=st.one_of(st.none(), st.integers(0, 64)),
       exact=st.booleans())
def test_derived_limits_are_always_valid_and_leave_a_lone_tenant_room(slots, kv, fallback,
                                                                      waiting, exact) -> None:
    shape = EngineShape(slots=slots, slots_exact=exact, kv_blocks=kv,
                        block_size=16 if kv else None)
    limits = derive_limits(Admission(max_inflight_per_backend=fallback,
                                     max_backend_waiting=waiting), shape)
    assert isinstance(limits, GateLimits)  # __post_init__ checked headroom < caps
    if limits.kv_blocks is not None:
        assert limits.kv_watermark is not None and limits.kv_watermark >= 1


def test_configured_caps_and_headroom_keep_their_meaning_once_slots_are_learned() -> None:
    shape = EngineShape(slots=16, slots_exact=True)
    limits = derive_limits(Admission(max_inflight_per_backend=16, headroom_slots=4,
                                     max_backend_waiting=8), shape)
    assert limits.max_running == 16  # the configured in-flight cap still bounds it
    assert limits.max_running - limits.headroom_slots == 12
    limits = derive_limits(Admission(headroom_slots=4, max_backend_waiting=8), shape)
    assert limits.max_running == 24  # 16 running, 8 waiting
    assert limits.max_running - limits.headroom_slots == 12  # 4 running slots kept free
