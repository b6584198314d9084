"""Utilisation rho (issue 41, point 3): the offered token work against the seed's capacity
B / t_step, per backend and per pool, with t_step the time of a full step learned from the
engine's scrapes (weighbridge.sidecar.stability)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.metrics import SidecarMetrics
from weighbridge.sidecar.stability import StabilityMeter, StepTime, pool_label
from weighbridge.statistics import step_capacity, utilisation
from weighbridge.vllm_metrics import BackendSample

B = 2048


def test_one_engine_reads_offered_times_step_over_budget() -> None:
    """The seed's λ(m_p + m_d) < B / t_step as one number: 10,000 tokens/s on an engine
    whose full step of 2,048 tokens takes 0.1 s (20,480 tokens/s) is rho = 0.49."""
    capacity = step_capacity(B, 0.1)
    assert capacity is not None and capacity == pytest.approx(20_480)
    assert utilisation(10_000, [capacity]) == pytest.approx(10_000 * 0.1 / B)
    # Several engines add their capacities; an unknown step time is no capacity at all.
    assert utilisation(10_000, [20_480, 20_480]) == pytest.approx(10_000 / 40_960)
    assert step_capacity(B, None) is None and step_capacity(B, 0.0) is None
    assert utilisation(10_000, []) is None


def _scrapes(step: StepTime, fixed_s: float, per_token_s: float,
             tokens_per_step: list[int], running: int = 8, steps_per_scrape: int = 5) -> float:
    """Feed scrapes of an engine whose step takes ``fixed_s + per_token_s x n``: between
    two scrapes it runs ``steps_per_scrape`` steps of ``n`` tokens each, ``running``
    sequences decoding one token a step. Returns the time of the last scrape."""
    now, generated, processed = 0.0, 0.0, 0.0
    step.observe(now, generated, processed, running)
    for n in tokens_per_step:
        now += steps_per_scrape * (fixed_s + per_token_s * n)
        generated += steps_per_scrape * running
        processed += steps_per_scrape * n
        step.observe(now, generated, processed, running)
    return now


@given(fixed_ms=st.floats(1, 50), per_token_us=st.floats(1, 100),
       loads=st.lists(st.integers(16, 2048), min_size=3, max_size=40))
def test_the_full_step_of_a_linear_engine_is_read_at_the_budget(
        fixed_ms: float, per_token_us: float, loads: list[int]) -> None:
    """Steps of several sizes: the fit reads t_fixed + t_token x B exactly, whatever the
    load it saw; steps all of one size give their own time (nothing to read a slope from),
    which is the full step's only when they were full."""
    fixed, per_token = fixed_ms / 1000, per_token_us / 1e6
    step = StepTime(window_s=1e9)
    now = _scrapes(step, fixed, per_token, loads)
    full = step.full_s(now, B)
    assert full is not None
    if len(set(loads)) > 1:
        assert full == pytest.approx(fixed + per_token * B, rel=1e-6)
    else:
        assert full == pytest.approx(fixed + per_token * loads[0], rel=1e-6)
    mean = step.mean_s(now)
    assert mean is not None and mean <= full * (1 + 1e-9)


@given(points=st.lists(st.tuples(st.floats(0.001, 1), st.integers(0, 50), st.integers(1, 5000),
                                 st.integers(1, 256)), min_size=2, max_size=30))
def test_the_full_step_stays_between_the_bounds_the_data_give(
        points: list[tuple[float, int, int, int]]) -> None:
    """Whatever the scrapes (noise, bursts): at least the mean step, at most B times the
    mean seconds per token (where rho is offered over served tokens)."""
    step = StepTime(window_s=1e9)
    now, generated, processed = 0.0, 0.0, 0.0
    step.observe(now, generated, processed, 1)
    busy = steps = tokens = 0.0
    previous_running = 1
    for dt, decoded, computed, running in points:
        now += dt
        generated += decoded
        processed += decoded + computed
        step.observe(now, generated, processed, running)
        if decoded > 0:
            n = decoded / ((previous_running + running) / 2)
            busy, steps, tokens = busy + dt, steps + n, tokens + decoded + computed
        previous_running = running
    full = step.full_s(now, B)
    if steps == 0:
        assert full is None
        return
    assert full is not None
    mean_step = busy / steps
    assert full >= mean_step * (1 - 1e-9)
    assert full <= max(mean_step, busy / tokens * B) * (1 + 1e-9)


def test_no_decoding_in_the_window_is_no_step_time() -> None:
    step = StepTime(window_s=10)
    step.observe(0, 100, 1000, 0)
    step.observe(1, 100, 1000, 0)  # idle: nothing decoded
    assert step.full_s(1, B) is None and step.mean_s(1) is None
    step.observe(2, 140, 1200, 4)
    assert step.full_s(2, B) is not None
    assert step.full_s(2 + 10.5, B) is None  # the newest scrape is older than the window


def _meter_with_engines(steps_s: dict[str, float | None], now: float) -> StabilityMeter:
    """A meter that saw each backend decode at full steps of ``steps_s`` for ``now`` s."""
    meter = StabilityMeter(window_s=10)
    for backend, step_s in steps_s.items():
        if step_s is None:
            continue
        t = 0.0
        while t <= now:
            steps = t / step_s
            meter.observe_backend(backend, t, steps * B, steps * 4, 4)
            t += 0.5
    return meter


def test_rho_per_backend_and_per_pool() -> None:
    """Two backends with full steps of 0.1 s and 0.2 s (capacities 20,480 and 10,240
    tokens/s): what each was routed and what arrived for their pool, against them."""
    meter = _meter_with_engines({"a": 0.1, "b": 0.2}, 20)
    pool = frozenset({"a", "b"})
    for t in range(21):
        meter.offer(3000, pool)
        meter.route("a", 2000)
        meter.route("b", 1000)
        meter.sample(float(t))
    reading = meter.utilisation(20.0, {"a": None, "b": None}, {"a", "b"}, [pool], B)
    # Per second: 3,000 offered, 2,000 to a, 1,000 to b.
    assert reading.backends["a"] == pytest.approx(2000 * 0.1 / B, rel=1e-3)
    assert reading.backends["b"] == pytest.approx(1000 * 0.2 / B, rel=1e-3)
    assert reading.pools[pool_label(pool)] == pytest.approx(3000 / (20_480 + 10_240), rel=1e-3)
    assert pool_label(pool) == "a,b"
    # An unhealthy backend lends the pool no capacity.
    alone = meter.utilisation(20.0, {"a": None, "b": None}, {"a"}, [pool], B)
    assert alone.pools["a,b"] == pytest.approx(3000 / 20_480, rel=1e-3)


def test_rho_is_absent_while_the_step_time_is_unknown_and_zero_when_idle() -> None:
    """Unknown t_step: no value (not 0, which would read as "no load"); a backend with a
    known step time that nothing was routed to reads 0 once its counter spans the window."""
    meter = _meter_with_engines({"a": 0.1, "b": None}, 20)
    pool = frozenset({"a", "b"})
    for t in range(21):
        meter.route("a", 1000)
        meter.sample(float(t))
    first = meter.utilisation(20.0, {"a": None, "b": None}, {"a", "b"}, [pool], B)
    assert "b" not in first.backends  # never decoded: unknown
    assert first.pools == {}  # nothing offered yet has spanned half the window
    later = meter.utilisation(30.0, {"a": None, "b": None}, {"a", "b"}, [pool], B)
    # a's scrapes stopped at 20 s: its step time is still the window's until 30 s.
    assert later.backends["a"] == 0.0
    assert later.pools["a,b"] == 0.0  # only a's capacity counts: b has none known
    # What the gate learned stands in when the window has no decoding in it.
    learned = meter.utilisation(40.0, {"a": None, "b": 0.2}, {"a", "b"}, [pool], B)
    assert learned.backends == {"b": 0.0}


def test_a_pool_that_is_gone_is_forgotten() -> None:
    meter = _meter_with_engines({"a": 0.1}, 20)
    old, new = frozenset({"a"}), frozenset({"a", "b"})
    for t in range(21):
        meter.offer(1000, old)
        meter.sample(float(t))
    assert set(meter.utilisation(20.0, {"a": None}, {"a"}, [old], B).pools) == {"a"}
    assert set(meter.utilisation(20.5, {"a": None}, {"a"}, [new], B).pools) <= {"a,b"}


def test_metrics_export_rho_with_bounded_labels() -> None:
    """/metrics: one series per backend and per pool (a pool is its backends), the step time
    and the budget."""
    config = parse_config({
        "tenants": {"t": {"tier": "standard", "api_keys": ["plain:k"]}},
        "admission": {"step_budget_tokens": 1024},
        "backends": [{"name": "a", "url": "http://127.0.0.1:9"},
                     {"name": "b", "url": "http://127.0.0.1:10"}]})
    core = SchedulingCore(config)
    clock = [0.0]
    stability = StabilityMeter(window_s=10)
    metrics = SidecarMetrics(core, None, stability, lambda: clock[0])
    pool = frozenset({"a", "b"})
    for i in range(41):
        t = i * 0.5
        clock[0] = t
        # Engine a decodes 4 sequences in steps of 0.05 s holding 512 tokens each (all
        # alike: no slope to read, so the full step is taken as theirs).
        sample = BackendSample(at_s=t, waiting=0, running=4, kv_cache_usage=0.1,
                               generation_tokens_total=t / 0.05 * 4,
                               prompt_tokens_total=t / 0.05 * 508, preemptions_total=0)
        core.on_backend_metrics("a", sample)
        stability.observe_backend("a", t, sample.prompt_tokens_total
                                  + sample.generation_tokens_total,
                                  sample.generation_tokens_total, sample.running)
        metrics.offer("t", "standard", 500, pool)
        metrics.routed("a", 500)
        stability.sample(t)
    value = metrics.registry.get_sample_value
    assert value("weighbridge_step_budget_tokens") == 1024
    assert value("weighbridge_backend_step_seconds", {"backend": "a"}) == pytest.approx(0.05)
    assert value("weighbridge_backend_step_seconds", {"backend": "b"}) is None
    # 1,000 tokens/s routed to a, whose step takes 0.05 s, against a budget of 1,024.
    assert value("weighbridge_backend_utilisation_ratio", {"backend": "a"}) == \
        pytest.approx(1000 * 0.05 / 1024, rel=1e-3)
    assert value("weighbridge_backend_utilisation_ratio", {"backend": "b"}) is None
    assert value("weighbridge_pool_utilisation_ratio", {"pool": "a,b"}) == \
        pytest.approx(1000 * 0.05 / 1024, rel=1e-3)


def test_a_front_that_names_no_pool_offers_to_the_only_one() -> None:
    """A front that does not name the pool (the EPP's) counts for the fleet's only pool;
    with several pools such a request counts for none (its pool is unknown)."""
    def metrics_for(models: dict[str, list[str]]) -> tuple[SidecarMetrics, StabilityMeter]:
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": ["plain:k"]}},
            "backends": [{"name": name, "url": f"http://127.0.0.1:{9 + i}", "models": served}
                         for i, (name, served) in enumerate(models.items())]})
        stability = StabilityMeter(window_s=10)
        return SidecarMetrics(SchedulingCore(config), None, stability), stability

    one, meter = metrics_for({"a": ["m"], "b": ["m"]})
    one.offer("t", "standard", 100)
    assert meter.offered_by_pool == {frozenset({"a", "b"}): 100}
    two, meter = metrics_for({"a": ["m"], "b": ["n"]})
    two.offer("t", "standard", 100)
    assert meter.offered_by_pool == {}
    two.offer("t", "standard", 100, frozenset({"b"}))
    assert meter.offered_by_pool == {frozenset({"b"}): 100}
