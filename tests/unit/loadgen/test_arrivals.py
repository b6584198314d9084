from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.loadgen.arrivals import Burst, Closed, Gamma, OnOff, Poisson


def _sorted_within(times: list[float], start: float, end: float) -> bool:
    return all(start <= t < end for t in times) and times == sorted(times)


@settings(max_examples=50, deadline=None)
@given(st.floats(0.5, 500), st.floats(0, 100), st.integers(0, 2**32))
def test_poisson_rate_and_window(rate: float, start: float, seed: int) -> None:
    duration = 2000 / rate  # ~2000 arrivals expected
    times = list(Poisson(rate=rate).times(random.Random(seed), start, start + duration))
    assert _sorted_within(times, start, start + duration)
    assert abs(len(times) - 2000) < 6 * math.sqrt(2000)
    # Same seed, same schedule.
    assert times == list(Poisson(rate=rate).times(random.Random(seed), start,
                                                  start + duration))


@settings(max_examples=30, deadline=None)
@given(st.floats(1, 200), st.floats(0.2, 8), st.integers(0, 2**32))
def test_gamma_keeps_the_mean_rate_and_its_burstiness(rate: float, burstiness: float,
                                                      seed: int) -> None:
    times = list(Gamma(rate=rate, burstiness=burstiness).times(random.Random(seed), 0.0,
                                                               4000 / rate))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = sum(gaps) / len(gaps)
    assert abs(mean * rate - 1) < 0.25
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
    assert abs(cv2 / burstiness - 1) < 0.5


@given(st.integers(1, 5000), st.floats(0, 50), st.floats(0, 50), st.floats(0, 100))
def test_burst_is_exact(count: int, at_s: float, over_s: float, start: float) -> None:
    times = list(Burst(count=count, at_s=at_s, over_s=over_s).times(
        random.Random(0), start, math.inf))
    assert len(times) == count
    assert times[0] == start + at_s
    assert times == sorted(times)
    assert times[-1] <= start + at_s + over_s


def test_burst_is_cut_at_the_phase_end() -> None:
    times = list(Burst(count=100, at_s=0, over_s=10).times(random.Random(0), 0.0, 5.0))
    assert len(times) == 50


@settings(max_examples=30, deadline=None)
@given(st.floats(5, 100), st.floats(0.5, 5), st.floats(0.5, 5), st.integers(0, 2**32))
def test_on_off_is_silent_while_off(rate: float, on_s: float, off_s: float,
                                    seed: int) -> None:
    process = OnOff(rate=rate, on_s=on_s, off_s=off_s)
    end = 20 * (on_s + off_s)
    times = list(process.times(random.Random(seed), 10.0, 10.0 + end))
    assert _sorted_within(times, 10.0, 10.0 + end)
    assert all((t - 10.0) % (on_s + off_s) < on_s for t in times)
    expected = process.mean_rate() * end
    assert abs(len(times) - expected) < 6 * math.sqrt(expected) + 1


def test_scaling_multiplies_load() -> None:
    assert Poisson(rate=2).scaled(3).rate == 6
    assert Burst(count=10_000, over_s=20).scaled(0.2).count == 2000
    assert Closed(users=8).scaled(0.5).users == 4
    assert OnOff(rate=10, on_s=1, off_s=1).scaled(2).mean_rate() == 10


def test_closed_loop_think_times() -> None:
    rng = random.Random(1)
    assert Closed(users=1, think_s=0.5, think="fixed").think_time(rng) == 0.5
    draws = [Closed(users=1, think_s=2).think_time(rng) for _ in range(5000)]
    assert abs(sum(draws) / len(draws) - 2) < 0.15
