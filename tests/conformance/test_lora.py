"""LoRA adapters, one suite for the emulator and real vLLM CPU: /v1/models lists an adapter
given with ``--lora-modules``, and a request naming it is served under its name.

Real vLLM loads the adapter's files, so the suite writes one for the tiny model offline
(tests/conformance/adapter.py). The servers are the suite's flagged pair
(tests/conformance/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.adapter import ADAPTER
from tests.conformance.backends import MAX_MODEL_LEN, Backend, assert_error_body
from tests.support import loopback, metrics


@pytest.fixture
def backend(flagged_backend: Backend) -> Backend:
    """The servers started with ``--lora-modules`` and the suite's other shared flags."""
    return flagged_backend


def test_models_lists_the_adapter_after_the_base_model(backend: Backend,
                                                       adapter_dir: Path) -> None:
    r = loopback.get(backend.url + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    cards = r.json()["data"]
    assert [c["id"] for c in cards] == [backend.model, ADAPTER]
    base, adapter = cards
    assert base["parent"] is None and base["max_model_len"] == MAX_MODEL_LEN
    assert adapter["root"] == str(adapter_dir) and adapter["parent"] == backend.model
    assert adapter["max_model_len"] is None
    assert set(adapter) == set(base)
    assert (adapter["object"], adapter["owned_by"]) == ("model", "vllm")


def test_a_request_naming_the_adapter_is_answered_under_its_name(backend: Backend) -> None:
    body = {"model": ADAPTER, "prompt": [7, 8, 9, 10, 11], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0}
    r = loopback.post(backend.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ADAPTER
    assert r.json()["usage"]["completion_tokens"] == 4
    chat = loopback.post(backend.url + "/v1/chat/completions", timeout=60, json={
        "model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "ignore_eos": True, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == ADAPTER


def test_an_unknown_model_is_a_404_naming_the_served_model(backend: Backend) -> None:
    r = loopback.post(backend.url + "/v1/completions", timeout=10,
                   json={"model": "no-such-adapter", "prompt": [7, 8], "max_tokens": 1})
    assert_error_body(r, 404)
    assert r.json()["error"]["message"] == (
        f"The model `no-such-adapter` does not exist. Valid aliases: {backend.model}.")


def test_lora_requests_info_names_the_adapter_of_a_request_in_flight(backend: Backend) -> None:
    body = {"model": ADAPTER, "prompt": [7, 8, 9], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    assert loopback.post(backend.url + "/v1/completions", json=body, timeout=60).status_code == 200
    scrape = metrics.scrape(backend.url)
    assert scrape.types.get("vllm:lora_requests_info") == "gauge"
    series = [labels for labels, _ in scrape.samples["vllm:lora_requests_info"]]
    assert {frozenset(s) for s in series} == {
        frozenset({"max_lora", "waiting_lora_adapters", "running_lora_adapters"})}
    assert all(s["max_lora"] == "1" for s in series)
    # vLLM 0.32 lists every adapter with a request in the engine under both labels.
    assert {"running_lora_adapters": ADAPTER, "waiting_lora_adapters": ADAPTER,
            "max_lora": "1"} in series
