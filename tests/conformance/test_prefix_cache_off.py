"""``--no-enable-prefix-caching`` on both backends: nothing is found, nothing counted, and
``vllm:cache_config_info`` says so (the suite's other servers run with vLLM's default, on)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conformance.backends import (
    Backend,
    emulator_backend,
    real_vllm,
)
from tests.conformance.test_prefix_cache import HITS, QUERIES, _ids
from tests.support import metrics


@pytest.fixture(scope="module")
def emulator_off_backend() -> Iterator[Backend]:
    with emulator_backend(enable_prefix_caching=False,
                          enable_prompt_tokens_details=True) as backend:
        yield backend


@pytest.fixture(scope="module")
def vllm_off_backend() -> Iterator[Backend]:
    with real_vllm(enable_prefix_caching=False, enable_prompt_tokens_details=True) as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator_off", pytest.param("vllm_off", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_without_the_cache_a_repeat_computes_every_token(backend: Backend,
                                                         endpoint: str) -> None:
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": _ids("off", 300)}
    else:
        path, body = "/v1/chat/completions", {"messages": [
            {"role": "system", "content": "Answer in one line. " * 30},
            {"role": "user", "content": "Hello"}]}
    for _ in range(2):
        r = httpx.post(backend.url + path, json={
            "model": backend.model, "max_tokens": 2, "ignore_eos": True, "temperature": 0,
            **body}, timeout=120)
        assert r.status_code == 200, r.text
        details = r.json()["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == 0
        # Nothing is put in a cache that is off (chat says so; completions leaves it null).
        assert details["created_cache_tokens"] == (0 if endpoint == "chat" else None)
    m = metrics.scrape(backend.url)
    assert (m.total(QUERIES), m.total(HITS)) == (0, 0)
    (cache, _), = m.samples["vllm:cache_config_info"]
    assert cache["enable_prefix_caching"] == "False"
