"""ModelCatalog: a request's model -> the backends that may serve it (its pool)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.catalog import ModelCatalog

BACKENDS = ["b1", "b2", "b3"]
MODELS = ["llama", "llama-sql", "qwen", "mistral"]

served_lists = st.dictionaries(
    st.sampled_from(BACKENDS), st.lists(st.sampled_from(MODELS), unique=True), max_size=3)


@given(served_lists, st.sampled_from([*MODELS, "typo"]))
def test_a_model_s_pool_is_its_servers_plus_every_unknown_backend(
        learned: dict[str, list[str]], model: str) -> None:
    catalog = ModelCatalog(BACKENDS)
    for backend, models in learned.items():
        catalog.learn(backend, models)
    expected = {b for b in BACKENDS if b not in learned or model in learned[b]}
    assert catalog.backends_for(model) == expected


@given(served_lists, st.sampled_from(MODELS), st.sampled_from(MODELS))
def test_two_models_share_a_pool_exactly_when_the_same_backends_serve_both(
        learned: dict[str, list[str]], m1: str, m2: str) -> None:
    catalog = ModelCatalog(BACKENDS)
    for backend, models in learned.items():
        catalog.learn(backend, models)
    same = all(b not in learned or ((m1 in learned[b]) == (m2 in learned[b]))
               for b in BACKENDS)
    assert (catalog.backends_for(m1) == catalog.backends_for(m2)) == same


def test_before_anything_is_known_the_fleet_is_one_pool() -> None:
    catalog = ModelCatalog(BACKENDS)
    assert catalog.backends_for("anything") == set(BACKENDS)
    assert catalog.backends_for(None) == set(BACKENDS)
    assert catalog.default_model() is None


def test_a_model_nobody_serves_has_no_pool_once_every_backend_is_known() -> None:
    catalog = ModelCatalog(BACKENDS[:2])
    catalog.learn("b1", ["llama", "llama-sql"])
    assert catalog.backends_for("qwen") == {"b2"}  # b2 has not said yet
    catalog.learn("b2", ["qwen"])
    assert catalog.backends_for("mistral") == frozenset()
    assert catalog.backends_for("llama-sql") == {"b1"}
    assert catalog.models() == {"llama": {"b1"}, "llama-sql": {"b1"}, "qwen": {"b2"}}


def test_a_request_without_model_gets_what_vllm_would_serve_it_with() -> None:
    catalog = ModelCatalog(BACKENDS[:2])
    catalog.learn("b2", ["qwen"])
    assert catalog.default_model() == "qwen"  # the first known backend's first model
    catalog.learn("b1", ["llama", "llama-sql"])
    assert catalog.default_model() == "llama"  # config order wins once b1 is known
    assert catalog.backends_for(None) == {"b1"}
    pinned = ModelCatalog(BACKENDS[:2], default_model="qwen")
    pinned.learn("b1", ["llama"])
    pinned.learn("b2", ["qwen"])
    assert pinned.backends_for(None) == {"b2"}


def test_declared_models_are_not_overwritten_by_discovery() -> None:
    catalog = ModelCatalog(BACKENDS[:2], {"b1": ["llama"]})
    assert catalog.known("b1") and not catalog.known("b2")
    assert catalog.learn("b1", ["qwen"]) is False
    assert catalog.models_of("b1") == ("llama",)
    assert catalog.learn("b2", ["qwen", "qwen"]) is True  # each listed once
    assert catalog.learn("b2", ["qwen"]) is False  # unchanged
    assert catalog.models_of("b2") == ("qwen",)
    with pytest.raises(ValueError, match="unknown backend"):
        catalog.learn("b9", ["x"])
