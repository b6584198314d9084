from __future__ import annotations

import pytest

from weighbridge.sidecar.tiers import TierSelector

RANKS = {"batch": 3, "interactive": 1, "standard": 2}


def test_strict_order_by_rank_with_fallbacks() -> None:
    sel = TierSelector(RANKS)
    assert sel.order(lambda t: True) == ["interactive", "standard", "batch"]
    assert sel.order(lambda t: t != "interactive") == ["standard", "batch"]
    assert sel.order(lambda t: False) == []


def test_anti_starvation_split_over_three_tiers() -> None:
    sel = TierSelector(RANKS, anti_starvation_weight=0.5)
    firsts = [sel.order(lambda t: True)[0] for _ in range(400)]
    assert firsts.count("interactive") == 200
    assert firsts.count("standard") == 100
    assert firsts.count("batch") == 100


def test_a_yielding_tier_stays_first_fallback() -> None:
    sel = TierSelector({"hi": 1, "lo": 2}, anti_starvation_weight=0.5)
    assert sel.order(lambda t: True) == ["hi", "lo"]
    assert sel.order(lambda t: True) == ["lo", "hi"]


def test_validation() -> None:
    with pytest.raises(ValueError):
        TierSelector(RANKS, anti_starvation_weight=1.0)
    with pytest.raises(ValueError):
        TierSelector({"a": 1, "b": 1})
