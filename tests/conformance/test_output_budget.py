"""The output budget and the token ids as vLLM reads them, on both backends: the rule the
sidecar limits and charges by (weighbridge.output_budget) is the engine's own.

- chat generates ``max_completion_tokens`` when it is set (not null), whatever ``max_tokens``
  says, and ``max_tokens`` otherwise;
- completions read ``max_tokens`` alone, 16 when it is absent or null;
- a token id below 0 or beyond any vocabulary (int64 and beyond) is a 400.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conformance.backends import Backend, assert_error_body
from tests.conformance.test_conformance import chat_body, completion_body
from tests.support import loopback
from weighbridge.output_budget import COMPLETIONS_DEFAULT_MAX_TOKENS


def generated(backend: Backend, path: str, body: dict[str, Any]) -> int:
    r = loopback.post(backend.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 1, "max_completion_tokens": 5}, 5),
    ({"max_tokens": 6, "max_completion_tokens": 2}, 2),
    ({"max_tokens": 3, "max_completion_tokens": None}, 3),
    ({"max_completion_tokens": 4}, 4),
])
def test_chat_generates_max_completion_tokens_over_max_tokens(
        backend: Backend, fields: dict[str, Any], expected: int) -> None:
    body = chat_body(backend)
    del body["max_tokens"]
    assert generated(backend, "/v1/chat/completions", {**body, **fields}) == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, COMPLETIONS_DEFAULT_MAX_TOKENS),
    ({"max_tokens": None}, COMPLETIONS_DEFAULT_MAX_TOKENS),
    ({"max_tokens": 3, "max_completion_tokens": 7}, 3),
])
def test_completions_read_max_tokens_alone_16_by_default(
        backend: Backend, fields: dict[str, Any], expected: int) -> None:
    body = completion_body(backend)
    del body["max_tokens"]
    assert generated(backend, "/v1/completions", {**body, **fields}) == expected


def test_chat_max_completion_tokens_beyond_the_model_is_400(backend: Backend) -> None:
    body = chat_body(backend, max_tokens=1, max_completion_tokens=backend.max_model_len + 1)
    r = loopback.post(backend.url + "/v1/chat/completions", json=body, timeout=10)
    assert_error_body(r, 400)
    assert "max_completion_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("token_id", [-1, 2**63 - 1, 2**63, 2**64])
def test_a_token_id_outside_the_vocabulary_is_400(backend: Backend, token_id: int) -> None:
    body = completion_body(backend, prompt=[5, token_id])
    r = loopback.post(backend.url + "/v1/completions", json=body, timeout=10)
    assert_error_body(r, 400)
