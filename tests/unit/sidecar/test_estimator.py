from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_keyed_by_model() -> None:
    """Decision 0019 (d): one tenant's answers on two models are two estimates."""
    est = OutputEstimator({"/chat": 300})
    est.observe("a", "/chat", 32, "model-a")
    est.observe("a", "/chat", 1024, "model-b")
    assert est.estimate("a", "/chat", None, model="model-a") == 32
    assert est.estimate("a", "/chat", None, model="model-b") == 1024
    assert est.estimate("a", "/chat", None) == 300  # no model: a key of its own
    assert est.final("a", "/chat", 0, None, "model-b") == 1024
    assert est.final("a", "/chat", 0, None, "model-c") is None


def test_final_of_a_bimodal_tenant() -> None:
    """Decision 0018: an answer counts at the mix's mean until it outgrows the short mode,
    then at the long mode's size."""
    est = OutputEstimator({"/chat": 300})
    assert est.final("a", "/chat", 0, None) is None  # nothing seen
    for _ in range(4):
        est.observe("a", "/chat", 20)
    est.observe("a", "/chat", 960)
    assert est.final("a", "/chat", 0, None) == 208  # (4 x 20 + 960) / 5
    assert est.final("a", "/chat", 24, None) == 960
    assert est.final("a", "/chat", 24, 500) == 500  # capped
    assert est.final("a", "/chat", 2000, None) == 2000  # past all: what it has


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=400), st.integers(0, 6000),
       st.one_of(st.none(), st.integers(0, 6000)))
def test_final_properties(outputs: list[int], generated: int, cap: int | None) -> None:
    est = OutputEstimator({"/chat": 300})
    for tokens in outputs:
        est.observe("a", "/chat", tokens)
    window = outputs[-OutputEstimator.HISTORY:]
    final = est.final("a", "/chat", generated, cap)
    assert final is not None
    if cap is None:
        assert final >= generated  # never below what it has
    else:
        assert final <= cap and final >= min(generated, cap)
    if generated == 0 and cap is None and min(window) > 0:
        assert final == round(sum(window) / len(window))  # at 0: the window's mean
    longer = [t for t in window if t > generated]
    expected = round(sum(longer) / len(longer)) if longer else generated
    assert final == (expected if cap is None else min(expected, cap))


def test_history_is_bounded_and_shared_outputs_join_it() -> None:
    est = OutputEstimator({"/chat": 300})
    for _ in range(OutputEstimator.HISTORY):
        est.observe("a", "/chat", 10)
    est.learn("a", "/chat", None, 1010)  # another replica's: the history, not the EMA
    assert est.estimate("a", "/chat", None) == 10
    # The oldest of 256 left: 255 x 10 + 1010 over 256.
    assert est.final("a", "/chat", 0, None) == round((255 * 10 + 1010) / 256)
    assert est.final("a", "/chat", 10, None) == 1010
