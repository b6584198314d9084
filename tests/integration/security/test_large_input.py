"""Inputs built to cost: bodies at the size limit that are deeply nested, wide, or a million
token ids; a max_tokens of 2**62 with no limit configured; invalid UTF-8 in headers. Each
gets a clear 4xx in bounded time and memory, and the sidecar carries on.

The small cases (deep JSON, invalid UTF-8 in the body, oversized and chunked bodies, huge
integers with a limit configured) are in tests/integration/sidecar/test_bad_input.py.
"""

from __future__ import annotations

import contextlib
import time

import orjson
import pytest

from tests.support import loopback
from tests.support.answers import assert_served
from tests.support.chaos import rss_bytes
from tests.support.ledger import ledger, settled
from tests.support.stack import (
    Stack,
    auth,
    completion,
    start_stack,
    tenant,
)

pytestmark = pytest.mark.timeout(120)

KEY = "sk-large"
LIMIT = 4 << 20  # the default max_body_bytes


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    return start_stack(processes, {
        "tenants": {"t": tenant("batch", KEY)},  # no max_tokens_limit: the backend decides
    })


def fill(prefix: bytes, unit: bytes, suffix: bytes) -> bytes:
    """``prefix + unit * n + suffix`` as large as fits the body limit."""
    n = (LIMIT - len(prefix) - len(suffix)) // len(unit)
    return prefix + unit * n + suffix


HEAVY: dict[str, tuple[bytes, str, int]] = {
    # name: (body, path, expected status)
    "deep-arrays": (b"[" * (LIMIT // 2) + b"]" * (LIMIT // 2), "/v1/completions", 400),
    "deep-objects": (fill(b"", b'{"a":', b"1"), "/v1/completions", 400),
    # Valid JSON (a repeated key, the last one wins) and a valid request: served.
    "wide-object": (fill(b'{"prompt": [1], ', b'"k0000000": 1, ', b'"max_tokens": 1}'),
                    "/v1/completions", 200),
    "million-token-ids": (fill(b'{"prompt": [', b"7,", b'7], "max_tokens": 1}'),
                          "/v1/completions", 400),
    "long-text-prompt": (fill(b'{"prompt": "', b"word ", b'", "max_tokens": 1}'),
                         "/v1/completions", 400),
    "many-messages": (fill(b'{"messages": [', b'{"role":"user","content":"hi"},',
                           b'{"role":"user","content":"hi"}], "max_tokens": 1}'),
                      "/v1/chat/completions", 400),
    "huge-max-tokens": (orjson.dumps({"prompt": [1, 2], "max_tokens": 2**62}),
                        "/v1/completions", 400),
    "huge-max-tokens-chat": (orjson.dumps({"messages": [{"role": "user", "content": "x"}],
                                           "max_completion_tokens": 2**62}),
                             "/v1/chat/completions", 400),
    "invalid-utf8-in-strings": (fill(b'{"prompt": "', b"\xc3\x28", b'"}'),
                                "/v1/completions", 400),
}


@pytest.mark.parametrize("name", list(HEAVY))
def test_heavy_body_is_a_clear_4xx_in_bounded_time_and_memory(stack: Stack, name: str) -> None:
    body, path, status = HEAVY[name]
    assert len(body) <= LIMIT
    before, rss_before = ledger(stack.sidecar), rss_bytes(stack.pid)
    started = time.monotonic()
    response = loopback.post(stack.sidecar + path, content=body, timeout=60,
                          headers={**auth(KEY), "content-type": "application/json"})
    took = time.monotonic() - started
    assert response.status_code == status, response.text[:300]
    if status != 200:
        assert response.json()["error"]["message"]
    # Bounded: seconds, not minutes, on a busy 2-core machine; and a few copies of the
    # body in memory, not an explosion of it (the RSS a parse leaves behind).
    assert took < 20, took
    assert rss_bytes(stack.pid) - rss_before < 24 * LIMIT, name
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.completed == (status == 200)
    assert_served(loopback.post(stack.sidecar + "/v1/completions", json=completion(),
                             headers=auth(KEY), timeout=30), "t")


@pytest.mark.parametrize("header", ["authorization", "x-weighbridge-tier",
                                    "x-weighbridge-deadline-ms", "x-anything"])
def test_invalid_utf8_in_headers_is_not_a_5xx(stack: Stack, header: str) -> None:
    value = b"Bearer " + KEY.encode() + b"\xff\xfe" if header == "authorization" \
        else b"\xc3\x28\xff"
    headers = {**auth(KEY), "content-type": "application/json", header: value}
    response = loopback.post(stack.sidecar + "/v1/completions", content=orjson.dumps(completion()),
                          headers=headers, timeout=30)
    assert response.status_code < 500, response.text
    if header in ("authorization", "x-weighbridge-tier", "x-weighbridge-deadline-ms"):
        assert 400 <= response.status_code < 500
        assert response.json()["error"]["code"] in {"unauthorized", "unknown_tier",
                                                    "invalid_deadline"}
    else:
        assert_served(response, "t")
    settled(stack.sidecar)
