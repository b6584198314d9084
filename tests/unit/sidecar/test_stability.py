"""The sidecar's stability meter: windowed counter rates (with resets) and the offered /
capacity ratio."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from weighbridge.sidecar.stability import CounterRate, StabilityMeter


@given(rate=st.floats(0, 1e6), step=st.floats(0.01, 2), n=st.integers(2, 200),
       window=st.floats(0.5, 30))
def test_a_steady_counter_reads_its_rate(rate: float, step: float, n: int,
                                         window: float) -> None:
    counter = CounterRate(window)
    for i in range(n):
        counter.observe(i * step, rate * i * step)
    now = (n - 1) * step
    got = counter.rate(now)
    assert got is not None
    assert math.isclose(got, rate, rel_tol=1e-6, abs_tol=1e-6)


@given(increments=st.lists(st.floats(0, 1e4), min_size=2, max_size=100),
       reset_at=st.integers(1, 99))
def test_a_reset_counts_the_new_value_as_increase(increments: list[float],
                                                  reset_at: int) -> None:
    """A backend that restarts (its counter drops) neither makes the rate negative nor loses
    what it served after the restart: the same as Prometheus' rate()."""
    # A restart is visible only when the counter drops (as for Prometheus).
    assume(reset_at >= len(increments) or increments[reset_at] < sum(increments[:reset_at]))
    counter = CounterRate(window_s=1e9)
    value, total = 0.0, 0.0
    for i, inc in enumerate(increments):
        if i == reset_at:
            value = 0.0  # restarted: counting from zero again
        value += inc
        total += inc
        counter.observe(float(i), value)
    got = counter.rate(len(increments) - 1.0)
    assert got is not None and got >= 0
    # The first observation is the anchor; its value is not part of the increase.
    expected = (total - increments[0]) / (len(increments) - 1)
    assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-6)


def test_the_window_forgets_old_load() -> None:
    counter = CounterRate(window_s=10)
    for t in range(0, 21):  # 100/s for 10 s, then 0/s
        counter.observe(float(t), 100.0 * min(t, 10))
    assert counter.rate(20.0) == 0.0
    counter = CounterRate(window_s=10)
    for t in range(0, 21):  # idle, then 50/s
        counter.observe(float(t), 50.0 * max(0, t - 10))
    assert counter.rate(20.0) == 50.0


def test_unknown_until_two_samples_and_after_the_source_goes_quiet() -> None:
    counter = CounterRate(window_s=5)
    assert counter.rate(0.0) is None
    counter.observe(0.0, 0.0)
    assert counter.rate(0.0) is None
    counter.observe(1.0, 10.0)
    assert counter.rate(1.0) == 10.0
    assert counter.rate(6.0) == 10.0
    assert counter.rate(6.5) is None  # the last scrape is older than the window
    counter.observe(0.5, 99.0)  # out of order: ignored
    assert counter.rate(1.0) == 10.0


def test_ratio_of_offered_load_to_healthy_backends_capacity() -> None:
    meter = StabilityMeter(window_s=10)
    for t in range(11):
        if t:
            meter.offer(300.0)  # 300 tokens a second arrive
        meter.sample(float(t))
        meter.observe_backend("a", float(t), 100.0 * t)
        meter.observe_backend("b", float(t), 100.0 * t)
    reading = meter.read(10.0, healthy=["a", "b"])
    assert reading.capacity_source == "backends"
    assert reading.capacity_tokens_per_s == pytest.approx(200.0)
    assert reading.offered_tokens_per_s == pytest.approx(300.0)
    assert reading.ratio == pytest.approx(1.5)
    # An unhealthy backend's capacity does not count.
    assert meter.read(10.0, healthy=["a"]).capacity_tokens_per_s == pytest.approx(100.0)


def test_without_scrapes_the_sidecars_own_throughput_stands_in() -> None:
    meter = StabilityMeter(window_s=10)
    meter.sample(0.0)
    meter.offer(50.0)
    reading = meter.read(1.0, healthy=["a"], sidecar_tokens_per_s=25.0)
    assert reading.capacity_source == "sidecar"
    assert reading.ratio == pytest.approx(2.0)
    assert meter.read(1.0, healthy=["a"]).ratio is None  # nothing measured at all
    assert StabilityMeter().read(0.0, healthy=[]).offered_tokens_per_s is None
