"""Token share and entitled share (Jain's index: tests/unit/test_statistics.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.exporters.share import TokenShareWindow, entitled_shares

amounts = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)


weight_maps = st.dictionaries(st.text("abcdef", min_size=1, max_size=3),
                              st.floats(0.01, 100), max_size=8)


@given(weight_maps, st.sets(st.text("abcdefg", min_size=1, max_size=3), max_size=8))
def test_entitled_shares_sum_to_one_and_follow_weights(weights: dict[str, float],
                                                       active: set[str]) -> None:
    shares = entitled_shares(weights, active)
    assert set(shares) == active
    if active:
        assert math.fsum(shares.values()) == pytest.approx(1.0)
    for a in active:
        for b in active:
            # share ratio = weight ratio; unweighted tenants weigh 1
            assert shares[a] * weights.get(b, 1.0) == pytest.approx(
                shares[b] * weights.get(a, 1.0))


def test_hand_computed_window() -> None:
    w = TokenShareWindow(10.0, weights={"a": 3.0, "b": 1.0})
    w.ended("a", 300, 1.0)
    w.ended("b", 100, 2.0)
    r = w.reading(5.0)
    assert r.share == pytest.approx({"a": 0.75, "b": 0.25})
    assert r.entitled == pytest.approx({"a": 0.75, "b": 0.25})
    assert r.jain == pytest.approx(1.0)
    # c is in flight: active, entitled to 1/5, served nothing yet -> Jain drops.
    r = w.reading(5.0, in_flight={"c"})
    assert r.entitled == pytest.approx({"a": 0.6, "b": 0.2, "c": 0.2})
    assert r.share.get("c", 0.0) == 0.0
    assert r.jain == pytest.approx((100 + 100) ** 2 / (3 * (100**2 + 100**2)))
    # a's completion leaves the window at 11; b's at 12.
    r = w.reading(11.5)
    assert r.served == {"b": 100.0}
    assert r.share == {"b": 1.0}
    assert r.entitled == {"b": 1.0}
    r = w.reading(30.0)
    assert r.served == {} and r.entitled == {} and r.jain is None


def test_rejected_tenant_is_active_with_nothing_served() -> None:
    w = TokenShareWindow(10.0)
    w.ended("a", 500, 1.0)
    w.ended("b", 0, 1.0)  # rejected: no usage
    r = w.reading(2.0)
    assert r.entitled == {"a": 0.5, "b": 0.5}
    assert r.share == {"a": 1.0, "b": 0.0}
    assert r.jain == pytest.approx(0.5)


def test_jain_among_one_tier() -> None:
    w = TokenShareWindow(10.0, weights={"a": 2.0})
    w.ended("a", 200, 1.0)
    w.ended("b", 100, 1.0)
    w.ended("z", 5, 1.0)
    r = w.reading(2.0)
    assert r.jain_among({"a", "b"}, w.weights) == pytest.approx(1.0)
    assert r.jain is not None and r.jain < 1.0


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 10_000),
                          st.floats(0, 100)), max_size=60),
       st.floats(0, 200))
def test_window_share_matches_the_records_in_it(ends: list[tuple[str, int, float]],
                                                at: float) -> None:
    """Share = each tenant's tokens among the ends in (at - window, at], from scratch."""
    w = TokenShareWindow(20.0)
    for tenant, tokens, t in sorted(ends, key=lambda e: e[2]):
        w.ended(tenant, tokens, t)
    inside = [(tenant, tokens) for tenant, tokens, t in ends if at - 20.0 < t]
    r = w.reading(at)
    expected: dict[str, float] = {}
    for tenant, tokens in inside:
        expected[tenant] = expected.get(tenant, 0) + tokens
    assert r.served == pytest.approx(expected)
    total = sum(expected.values())
    if total:
        assert math.fsum(r.share.values()) == pytest.approx(1.0)
        for tenant, tokens in expected.items():
            assert r.share[tenant] == pytest.approx(tokens / total)
    assert set(r.entitled) == set(expected)


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError, match=r"weights\.a"):
        TokenShareWindow(10.0, weights={"a": 0.0})
    with pytest.raises(ValueError, match="window_s"):
        TokenShareWindow(0.0)
