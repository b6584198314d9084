from __future__ import annotations

import pytest

from weighbridge.sidecar.estimator import DEFAULT_INITIAL_ESTIMATE, OutputEstimator


def test_seeded_per_endpoint_then_learned_per_tenant() -> None:
    est = OutputEstimator({"/chat": 300}, alpha=0.5)
    assert est.estimate("a", "/chat", None) == 300
    assert est.estimate("a", "/other", None) == DEFAULT_INITIAL_ESTIMATE
    est.observe("a", "/chat", 100)
    assert est.estimate("a", "/chat", None) == 100  # the first observation replaces the seed
    est.observe("a", "/chat", 200)
    assert est.estimate("a", "/chat", None) == 150
    assert est.estimate("b", "/chat", None) == 300  # per tenant


def test_always_bounded_by_max_tokens() -> None:
    est = OutputEstimator({"/chat": 300})
    assert est.estimate("a", "/chat", 50) == 50
    assert est.estimate("a", "/chat", 0) == 0


def test_alpha_is_validated() -> None:
    with pytest.raises(ValueError):
        OutputEstimator({}, alpha=0)
