"""Offered token load against served throughput."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.exporters.stability import StabilityWindow


def test_offered_is_arrival_rate_times_mean_served_size() -> None:
    s = StabilityWindow(10.0)
    s.backend_sample(0, 0.0)  # a single scrape is not a rate: the client's view is used
    for i in range(1, 21):  # 2 requests/s over the window (0, 10], declared 1000 tokens each
        s.scheduled(1000, i * 0.5)
    s.ended(300, True, 2.0)
    s.ended(100, True, 3.0)
    s.ended(0, False, 3.5)  # rejected: not a size sample
    r = s.reading(10.0)
    assert r.offered_tokens_per_s == pytest.approx(2.0 * 200)
    assert r.source == "client"
    assert r.served_tokens_per_s == pytest.approx(400 / 10)
    assert r.ratio == pytest.approx(10.0)


def test_declared_size_stands_in_before_anything_completed() -> None:
    s = StabilityWindow(10.0)
    s.scheduled(500, 0.0)
    s.scheduled(700, 5.0)
    s.scheduled(500, 10.0)
    r = s.reading(10.0)  # the window (0, 10] holds the last two
    assert r.offered_tokens_per_s == pytest.approx(2 / 10 * 600)
    assert r.served_tokens_per_s == 0.0
    assert r.ratio == math.inf
    assert math.isnan(StabilityWindow(5.0).reading(1.0).ratio)


def test_backend_rate_when_fresh_with_counter_reset() -> None:
    s = StabilityWindow(10.0, stale_after_s=3.0)
    s.scheduled(100, 0.0)
    for at, total in ((1.0, 1000), (3.0, 3000), (5.0, 500), (7.0, 2500)):
        s.backend_sample(total, at)
    r = s.reading(8.0)
    # 2000 + 500 (restart counts from 0) + 2000 over 6 s
    assert r.source == "backend"
    assert r.served_tokens_per_s == pytest.approx(4500 / 6)
    # Stale after 3 s without a scrape: the generator's own view takes over.
    s.ended(400, True, 8.5)
    r = s.reading(10.5)
    assert r.source == "client"
    assert r.served_tokens_per_s == pytest.approx(400 / 10)


def test_window_forgets_old_events() -> None:
    s = StabilityWindow(5.0)
    s.scheduled(100, 0.0)
    s.ended(100, True, 1.0)
    s.scheduled(100, 10.0)
    s.ended(50, True, 11.0)
    r = s.reading(12.0)
    assert r.offered_tokens_per_s == pytest.approx(1 / 5 * 50)
    assert r.served_tokens_per_s == pytest.approx(50 / 5)


@given(rate=st.floats(0.5, 50), size=st.integers(1, 4000), factor=st.floats(0.2, 5))
def test_ratio_is_offered_over_served(rate: float, size: int, factor: float) -> None:
    """Requests of one size arrive at ``rate``; the backend serves ``factor`` x that load."""
    s = StabilityWindow(20.0)
    n = int(rate * 20)
    s.scheduled(size * 3, 0.0)  # long before the window: only pins the clock's origin
    for i in range(n):
        s.scheduled(size * 3, 20.0 + (i + 1) / rate)
    s.ended(size, True, 30.0)
    s.backend_sample(0, 20.0)
    s.backend_sample(n * size * factor, 40.0)
    r = s.reading(40.0)
    assert r.source == "backend"
    assert r.ratio == pytest.approx(1 / factor, rel=1e-6)


def test_validation() -> None:
    with pytest.raises(ValueError, match="window_s"):
        StabilityWindow(0)
    with pytest.raises(ValueError, match="stale_after_s"):
        StabilityWindow(1, stale_after_s=0)
