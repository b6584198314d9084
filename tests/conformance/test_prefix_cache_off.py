"""``--no-enable-prefix-caching`` on both backends: nothing is found, nothing counted, and
``vllm:cache_config_info`` says so (the suite's other servers run with vLLM's default, on)."""

from __future__ import annotations

import pytest

from tests.conformance.backends import Backend
from tests.conformance.test_prefix_cache import HITS, QUERIES, _ids
from tests.support import loopback, metrics


@pytest.fixture
def backend(flagged_backend: Backend) -> Backend:
    """The servers started with ``--no-enable-prefix-caching`` and the suite's other shared
    flags (tests/conformance/conftest.py)."""
    return flagged_backend


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
        r = loopback.post(backend.url + path, json={
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
