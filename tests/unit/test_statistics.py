"""The shared statistics (weighbridge.statistics): percentile, Jain's index, stability ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.analysis.percentiles import QUANTILES, Percentiles
from weighbridge.statistics import jain_index, percentile, stability_ratio

amounts = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)

# -- percentile


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_is_within_the_data(values: list[float], q: float) -> None:
    ordered = sorted(values)
    assert ordered[0] <= percentile(ordered, q) <= ordered[-1]


def test_percentile_at_an_infinite_rank_is_infinite() -> None:
    # A starved request's TTFT counts as infinite; its rank must not read as nan.
    inf = float("inf")
    assert percentile([0.1, inf, inf], 0.99) == inf
    assert percentile([0.1, inf, inf], 0.5) == inf
    assert percentile([0.1, 0.2, inf], 0.5) == 0.2


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60))
def test_percentile_agrees_with_the_run_analysis_vectorised_one(values: list[float]) -> None:
    """analysis.percentiles computes the same definition over whole columns with numpy."""
    ordered = sorted(values)
    p = Percentiles.of(np.array(values))
    for name, q in QUANTILES.items():
        assert getattr(p, name) == pytest.approx(percentile(ordered, q), rel=1e-9, abs=1e-9)


def test_percentile_by_hand() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
    assert math.isnan(percentile([], 0.5))


# -- Jain's index


@given(st.lists(amounts, min_size=1, max_size=50))
def test_jain_lies_between_one_over_n_and_one(values: list[float]) -> None:
    j = jain_index(values)
    if sum(values) == 0:
        assert j is None
    else:
        assert j is not None
        assert 1 / len(values) - 1e-12 <= j <= 1.0


@given(st.floats(1e-6, 1e9), st.integers(1, 50))
def test_jain_is_one_for_equal_service(value: float, n: int) -> None:
    assert jain_index([value] * n) == pytest.approx(1.0)


@given(st.floats(1e-3, 1e9), st.integers(1, 50))
def test_jain_is_one_over_n_when_one_takes_everything(value: float, n: int) -> None:
    assert jain_index([value] + [0.0] * (n - 1)) == pytest.approx(1 / n)


@given(st.lists(st.floats(1e-3, 1e6), min_size=1, max_size=20), st.floats(1e-3, 1e3))
def test_jain_is_scale_invariant(values: list[float], scale: float) -> None:
    a, b = jain_index(values), jain_index([v * scale for v in values])
    assert a is not None and b is not None
    assert a == pytest.approx(b, rel=1e-9)


def test_jain_rejects_negative_and_is_none_when_empty() -> None:
    assert jain_index([]) is None
    with pytest.raises(ValueError, match="non-negative"):
        jain_index([1.0, -1.0])


def test_jain_by_hand() -> None:
    assert jain_index([5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([300, 50]) == pytest.approx(350**2 / (2 * (300**2 + 50**2)))
    assert jain_index([0, 0]) is None


# -- stability ratio


def test_stability_ratio_is_offered_over_served() -> None:
    assert stability_ratio(120.0, 100.0) == pytest.approx(1.2)  # the backlog grows
    assert stability_ratio(50.0, 100.0) == 0.5  # draining, or others share the backend
    assert stability_ratio(10.0, 0.0) == math.inf  # offered, nothing served
    assert stability_ratio(0.0, 0.0) is None  # idle: nothing to judge
    assert stability_ratio(0.0, 5.0) == 0.0  # serving a backlog, nothing new offered
