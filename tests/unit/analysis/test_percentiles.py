"""Exact percentiles (linear interpolation between closest ranks)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.analysis.percentiles import Percentiles, by_group


def test_linear_interpolation_by_hand() -> None:
    p = Percentiles.of([4.0, 1.0, 3.0, 2.0])
    # rank h = (n - 1) q: 1.5 -> 2.5; 2.7 -> 3.7; 2.97 -> 3.97; 2.997 -> 3.997
    assert (p.count, p.p50, p.p90, p.p99, p.p999) == (
        4, 2.5, pytest.approx(3.7), pytest.approx(3.97), pytest.approx(3.997))
    hundred = Percentiles.of(np.arange(101))
    assert (hundred.p50, hundred.p99) == (50.0, 99.0)


def test_missing_values_are_left_out() -> None:
    assert Percentiles.of([np.nan, 7.0]).p99 == 7.0
    assert Percentiles.of([np.nan]) == Percentiles(0, None, None, None, None)


def test_by_group_matches_one_at_a_time() -> None:
    values = pd.Series([1.0, 2.0, 3.0, 10.0, 20.0, np.nan])
    groups = pd.Series(["a", "a", "a", "b", "b", "b"], dtype="category")
    got = by_group(values, groups)
    for name, values_ in (("a", [1, 2, 3]), ("b", [10, 20])):
        one = Percentiles.of(values_)
        assert got[name].count == one.count
        assert [got[name].p50, got[name].p90, got[name].p99, got[name].p999] == pytest.approx(
            [one.p50, one.p90, one.p99, one.p999])


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200))
def test_percentiles_are_ordered_and_inside_the_data(values: list[float]) -> None:
    p = Percentiles.of(values)
    assert p.p50 is not None and p.p90 is not None and p.p99 is not None
    assert p.p999 is not None
    lo, hi = min(values), max(values)
    assert lo - 1e-6 <= p.p50 <= p.p90 + 1e-6 <= p.p99 + 2e-6 <= p.p999 + 3e-6 <= hi + 4e-6
