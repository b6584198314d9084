"""Jain's index, share ratio and VTC service difference on hand-computed service series."""

from __future__ import annotations

import numpy as np
import pytest

from weighbridge.analysis.fairness import fairness, share_ratio, tier_fairness

EDGES = np.array([0.0, 10.0, 20.0, 30.0])


def test_share_ratio_by_hand() -> None:
    assert share_ratio([300, 50]) == 6.0
    assert share_ratio([3, 0]) is None  # starved: unbounded


def test_weighted_tier_by_hand() -> None:
    # a weight 1, b weight 2. Window 0: both backlogged, a 100 and b 200 tokens: equal per
    # weight. Window 1: both backlogged, a 300, b 100. Window 2: only a backlogged.
    service = {"a": np.array([100.0, 300.0, 50.0]), "b": np.array([200.0, 100.0, 0.0])}
    backlogged = {"a": np.array([True, True, True]), "b": np.array([True, True, False])}
    t = tier_fairness("standard", EDGES, service, backlogged, {"a": 1.0, "b": 2.0})

    assert [w.jain_index for w in t.windows][:2] == [1.0, pytest.approx(122500 / 185000)]
    assert t.windows[2].jain_index is None  # one backlogged tenant says nothing
    assert [w.share_ratio for w in t.windows][:2] == [1.0, 6.0]
    # Entitlements: window 0 splits 300 as 100/200, window 1 splits 400 as 133.3/266.7:
    # a got 400 of 233.3 (12/7), b 300 of 466.7 (9/14).
    assert t.service_ratio == {"a": pytest.approx(12 / 7), "b": pytest.approx(9 / 14)}
    assert t.jain_index == pytest.approx(1089 / 1314)
    assert t.max_min_share_ratio == pytest.approx(8 / 3)
    # VTC counters (service / weight): after window 0 a 100, b 100; after window 1 a 400,
    # b 150 -> difference 250.
    assert [w.service_difference for w in t.windows] == [0.0, 250.0, None]
    assert t.max_service_difference == 250.0


def test_newly_backlogged_tenant_banks_no_credit() -> None:
    # b idles through window 0 while a is served 100; when b becomes backlogged its counter
    # is lifted to a's (100), so equal service afterwards shows no difference.
    service = {"a": np.array([100.0, 50.0, 50.0]), "b": np.array([0.0, 50.0, 50.0])}
    backlogged = {"a": np.array([True, True, True]), "b": np.array([False, True, True])}
    t = tier_fairness("standard", EDGES, service, backlogged, {"a": 1.0, "b": 1.0})
    assert [w.service_difference for w in t.windows] == [None, 0.0, 0.0]
    assert t.jain_index == 1.0
    assert t.max_min_share_ratio == 1.0


def test_starved_tenant_makes_the_ratio_unbounded() -> None:
    service = {"a": np.array([100.0, 100.0, 100.0]), "b": np.zeros(3)}
    backlogged = {"a": np.ones(3, bool), "b": np.ones(3, bool)}
    f = fairness(EDGES, service, backlogged, {"a": 1.0, "b": 1.0},
                 {"a": "standard", "b": "standard"}, 0.9, 10.0)
    assert f.tiers["standard"].starved == ("b",)
    assert f.jain_index == 0.5
    assert f.max_min_share_ratio is None
    assert f.max_service_difference == 300.0


def test_headline_is_the_worst_tier() -> None:
    service = {"a": np.array([100.0] * 3), "b": np.array([100.0] * 3),
               "c": np.array([100.0] * 3), "d": np.array([50.0] * 3)}
    backlogged = {n: np.ones(3, bool) for n in service}
    f = fairness(EDGES, service, backlogged, dict.fromkeys(service, 1.0),
                 {"a": "interactive", "b": "interactive", "c": "batch", "d": "batch"},
                 0.9, 10.0)
    assert f.tiers["interactive"].jain_index == 1.0
    assert f.jain_index == pytest.approx(150**2 / (2 * (100**2 + 50**2)))
    assert f.max_min_share_ratio == 2.0
    assert f.max_service_difference == 150.0
