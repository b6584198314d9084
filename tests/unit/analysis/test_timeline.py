"""Amounts spread over intervals, integrated per window: hand-computed cases and the
conservation property."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.analysis.timeline import (
    MIN_SPREAD_S,
    covered,
    cumulative,
    per_window,
    union,
    window_edges,
)


def test_window_edges_end_at_the_duration() -> None:
    assert window_edges(25, 10).tolist() == [0, 10, 20, 25]
    assert window_edges(20, 10).tolist() == [0, 10, 20]


def test_ramp_and_point_split_over_windows() -> None:
    # 21 tokens over [1, 3]: 10.5 per second-of-two; 10 tokens at exactly t=1 (a point).
    edges = [0.0, 2.0, 4.0]
    assert per_window([1.0], [3.0], [21.0], edges).tolist() == [10.5, 10.5]
    assert per_window([1.0], [1.0], [10.0], edges).tolist() == [10.0, 0.0]
    # A point on an edge belongs to the window that starts there: [t_k, t_k+1).
    assert per_window([2.0], [2.0], [5.0], edges).tolist() == [0.0, 5.0]


def test_cumulative_is_linear_inside_a_ramp() -> None:
    assert cumulative([0.0], [4.0], [8.0], [0.0, 1.0, 3.0, 4.0, 9.0]).tolist() == [
        0.0, 2.0, 6.0, 8.0, 8.0]


def test_union_merges_overlaps_and_touching_intervals() -> None:
    starts, ends = union([5.0, 0.0, 1.0, 3.0, 9.0], [6.0, 2.0, 3.0, 4.0, 9.0])
    assert starts.tolist() == [0.0, 5.0]
    assert ends.tolist() == [4.0, 6.0]
    assert covered([0.0, 1.0], [2.0, 3.0], [0.0, 2.5, 5.0]).tolist() == [2.5, 0.5]


intervals = st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50), st.floats(0, 1000)),
                     min_size=1, max_size=40)


@given(intervals, st.floats(0.5, 30))
def test_every_amount_lands_in_exactly_one_place(items: list[tuple[float, float, float]],
                                                 window: float) -> None:
    starts = np.array([s for s, _, _ in items])
    ends = starts + np.array([d for _, d, _ in items])
    amounts = np.array([a for _, _, a in items])
    edges = window_edges(float(ends.max()) + 1.0, window)
    got = per_window(starts, ends, amounts, edges)
    # The ramp sums cancel terms of size rate * t: float64 keeps ~1e-16 of that.
    durations = ends - starts
    rates = np.divide(amounts, durations, out=np.zeros_like(amounts),
                      where=durations >= MIN_SPREAD_S)
    tolerance = 1e-12 * float(rates.sum()) * float(edges[-1]) + 1e-9
    assert np.all(got >= -tolerance)
    assert abs(got.sum() - amounts.sum()) <= tolerance + 1e-12 * amounts.sum()
    cover = covered(starts, ends, edges)
    assert np.all(cover <= np.diff(edges) + 1e-9)


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50), st.floats(0, 1e4)),
                min_size=1, max_size=40), st.floats(0.1, 7.0))
def test_no_window_receives_a_negative_amount(items: list[tuple[float, float, float]],
                                              width: float) -> None:
    """The cumulative ramps' rounding once left -9e-13 in an empty window (Jain's index then
    refused the series and a report failed)."""
    starts = np.array([s for s, _, _ in items])
    ends = starts + np.array([d for _, d, _ in items])
    amounts = np.array([a for _, _, a in items])
    edges = np.arange(0.0, 160.0 + width, width)
    assert (per_window(starts, ends, amounts, edges) >= 0).all()
