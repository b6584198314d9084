"""Bad input gets a 4xx with an OpenAI error body and a reason, is counted as a rejection
under its tenant, and never reaches the backend; never a 5xx."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import orjson
import pytest

from tests.support import loopback
from tests.support.answers import assert_rejected, assert_served
from tests.support.bad_input import (
    BAD_BODIES,
    BAD_CHAT_BODIES,
    BAD_DEADLINES,
    BAD_EMBEDDING_BODIES,
    BAD_POOLING_BODIES,
    KEY,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
)
from tests.support.ledger import backend_finished, ledger, settled
from tests.support.stack import (
    Stack,
    auth,
    completion,
    start_stack,
    tenant,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    return start_stack(processes, {
        "tenants": {"t": tenant("standard", KEY)},
        "max_body_bytes": MAX_BODY_BYTES,
        "max_tokens_limit": MAX_TOKENS_LIMIT,
    })


def post(stack: Stack, body: bytes, path: str = "/v1/completions",
         headers: dict[str, str] | None = None) -> httpx.Response:
    return loopback.post(stack.sidecar + path, content=body,
                      headers={**auth(KEY), "content-type": "application/json",
                               **(headers or {})}, timeout=10)


def expect_rejected(stack: Stack, response: httpx.Response, status: int, reason: str) -> None:
    error = assert_rejected(response, status, reason)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "reason"), [(b, r) for _, b, r in BAD_BODIES],
                         ids=[name for name, _, _ in BAD_BODIES])
def test_bad_completion_body_is_400(stack: Stack, body: bytes, reason: str) -> None:
    before, seen = ledger(stack.sidecar), backend_finished(stack.emulator)
    expect_rejected(stack, post(stack, body), 400, reason)
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {reason: 1}
    assert ledger(stack.sidecar, tenant="t").rejected[reason] >= 1  # under its tenant
    assert backend_finished(stack.emulator) == seen  # the backend never saw it


@pytest.mark.parametrize(("body", "reason"), [(b, r) for _, b, r in BAD_CHAT_BODIES],
                         ids=[name for name, _, _ in BAD_CHAT_BODIES])
def test_bad_chat_body_is_400(stack: Stack, body: bytes, reason: str) -> None:
    before = ledger(stack.sidecar)
    expect_rejected(stack, post(stack, body, "/v1/chat/completions"), 400, reason)
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {reason: 1}


@pytest.mark.parametrize(("body", "reason"), [(b, r) for _, b, r in BAD_EMBEDDING_BODIES],
                         ids=[name for name, _, _ in BAD_EMBEDDING_BODIES])
def test_bad_embeddings_body_is_400(stack: Stack, body: bytes, reason: str) -> None:
    before, seen = ledger(stack.sidecar), backend_finished(stack.emulator)
    expect_rejected(stack, post(stack, body, "/v1/embeddings"), 400, reason)
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {reason: 1}
    assert backend_finished(stack.emulator) == seen


@pytest.mark.parametrize(("path", "body", "reason"),
                         [(p, b, r) for _, p, b, r in BAD_POOLING_BODIES],
                         ids=[name for name, _, _, _ in BAD_POOLING_BODIES])
def test_bad_pooling_body_is_400(stack: Stack, path: str, body: bytes, reason: str) -> None:
    before, seen = ledger(stack.sidecar), backend_finished(stack.emulator)
    expect_rejected(stack, post(stack, body, path), 400, reason)
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {reason: 1}
    assert backend_finished(stack.emulator) == seen


@pytest.mark.parametrize("value", BAD_DEADLINES)
def test_bad_deadline_header_is_400(stack: Stack, value: str) -> None:
    before = ledger(stack.sidecar)
    response = post(stack, orjson.dumps(completion()),
                    headers={"x-weighbridge-deadline-ms": value})
    expect_rejected(stack, response, 400, "invalid_deadline")
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {"invalid_deadline": 1}


def test_good_deadline_header_is_served(stack: Stack) -> None:
    response = post(stack, orjson.dumps(completion()),
                    headers={"x-weighbridge-deadline-ms": "30000.5"})
    assert_served(response, "t")


def test_max_tokens_at_the_limit_is_served(stack: Stack) -> None:
    response = post(stack, orjson.dumps(completion(MAX_TOKENS_LIMIT)))
    assert_served(response, "t")
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    settled(stack.sidecar)


def test_body_over_the_limit_is_413(stack: Stack) -> None:
    before = ledger(stack.sidecar)
    body = orjson.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10), "max_tokens": 4})
    response = post(stack, body)
    assert_rejected(response, 413, "body_too_large")
    # Just at the limit is fine (as far as size goes).
    body = orjson.dumps({"prompt": [1] * 10, "max_tokens": 4})
    body = body[:-1] + b" " * (MAX_BODY_BYTES - len(body)) + b"}"
    assert len(body) == MAX_BODY_BYTES
    assert_served(post(stack, body), "t")
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 2 and delta.rejected == {"body_too_large": 1}
    assert delta.completed == 1


def test_chunked_body_over_the_limit_is_413(stack: Stack) -> None:
    """Without a Content-Length the limit is enforced while reading."""
    before = ledger(stack.sidecar)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"y" * 2000
        yield b'", "max_tokens": 4}'

    response = loopback.post(stack.sidecar + "/v1/completions", content=chunks(),
                          headers={**auth(KEY), "content-type": "application/json"},
                          timeout=10)
    assert_rejected(response, 413, "body_too_large")
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {"body_too_large": 1}


async def test_body_far_over_the_limit_is_413_not_a_reset(stack: Stack) -> None:
    """A client that declares a 1 MiB body gets its 413 answer, even though the sidecar
    stops reading early."""
    before = await asyncio.to_thread(ledger, stack.sidecar)
    size = 1 << 20
    url = httpx.URL(stack.sidecar)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\n\r\n").encode()
        writer.write(head + b'{"prompt": "' + b"z" * 8192)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert status_line.split()[1] == b"413", status_line
    finally:
        writer.transport.abort()
    delta = await asyncio.to_thread(settled, stack.sidecar)
    assert (delta - before).rejected == {"body_too_large": 1}


@pytest.mark.parametrize(("method", "path", "status", "reason"), [
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("POST", "/v1/nowhere", 404, "not_found"),
    ("DELETE", "/admin/state", 405, "method_not_allowed"),
])
def test_wrong_route_is_4xx_with_an_error_body(stack: Stack, method: str, path: str,
                                               status: int, reason: str) -> None:
    response = loopback.request(method, stack.sidecar + path, headers=auth(KEY), timeout=10)
    assert_rejected(response, status, reason)


def test_backend_validation_errors_pass_through_as_4xx(stack: Stack) -> None:
    """What only the backend checks (an out-of-vocabulary token id, a context overflow) comes
    back as the backend's 4xx, not as a sidecar 5xx; the request is counted as failed."""
    before = ledger(stack.sidecar)
    response = post(stack, orjson.dumps({"prompt": [10 ** 9], "max_tokens": 4}))
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()
    # 2,100 emulator tokens (a word and a punctuation mark each) in a 2 KiB body.
    response = post(stack, orjson.dumps({"prompt": "a." * 1050, "max_tokens": 4}))
    assert 400 <= response.status_code < 500, response.text
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 2 and delta.failed == 2
    health = loopback.get(stack.sidecar + "/readyz", timeout=10)
    assert health.status_code == 200  # a 4xx from a backend does not make it unhealthy


def test_never_a_5xx_for_bad_input(stack: Stack) -> None:
    """Everything above, in one sweep: a 4xx and an error body, every time."""
    before = ledger(stack.sidecar)
    sent = 0
    for _, body, _ in BAD_BODIES:
        response = post(stack, body)
        sent += 1
        assert 400 <= response.status_code < 500 and "error" in response.json()
    for _, body, _ in BAD_CHAT_BODIES:
        response = post(stack, body, "/v1/chat/completions")
        sent += 1
        assert 400 <= response.status_code < 500 and "error" in response.json()
    for _, body, _ in BAD_EMBEDDING_BODIES:
        response = post(stack, body, "/v1/embeddings")
        sent += 1
        assert 400 <= response.status_code < 500 and "error" in response.json()
    for _, path, body, _ in BAD_POOLING_BODIES:
        response = post(stack, body, path)
        sent += 1
        assert 400 <= response.status_code < 500 and "error" in response.json()
    delta = settled(stack.sidecar) - before
    assert delta.arrived == sent == delta.rejected_total
