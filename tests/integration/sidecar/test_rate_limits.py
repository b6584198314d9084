"""Rate limits: 429 ``rate_limited`` with an integer Retry-After, and token limits that
charge the estimate at admission and settle with the backend's real ``usage`` at the end,
for whole and streamed answers alike."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.support import loopback
from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import admin_state, ledger, settled
from tests.support.stack import (
    ADMIN_KEY,
    Stack,
    auth,
    completion,
    start_stack,
    tenant,
)

pytestmark = pytest.mark.timeout(60)

# 10 tokens/s of refill: slow enough that a few seconds of test cannot blur a settlement of
# 144 tokens (the gap the settlement test relies on), fast enough to be a real bucket.
TOKENS_PER_MINUTE = 600
REFILL_PER_S = TOKENS_PER_MINUTE / 60
SERVED = "weighbridge-emulator"  # the emulator's model name (emulator/options.py)


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    # 2 ms steps: a 400-token answer takes about a second.
    tpm = {"tokens_per_minute": TOKENS_PER_MINUTE}
    return start_stack(processes, {
        "tenants": {
            "rpm": tenant("standard", "sk-rpm", limits={"requests_per_minute": 2}),
            "tpm-whole": tenant("standard", "sk-tpm-whole", limits=tpm),
            "tpm-stream": tenant("standard", "sk-tpm-stream", limits=tpm),
            "tiny": tenant("standard", "sk-tiny", limits={"tokens_per_minute": 100}),
            "per-endpoint": tenant("standard", "sk-endpoint", endpoint_limits={
                "/v1/chat/completions": {"requests_per_minute": 1}}),
            "per-model": tenant("standard", "sk-model", model_limits={
                SERVED: {"requests_per_minute": 2}}),
        },
        # A request without `model` is charged to the emulator's model.
        "default_model": SERVED,
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }, t_fixed=0.002)


def post(stack: Stack, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return loopback.post(stack.sidecar + path, json=body, headers=auth(key), timeout=30)


def test_requests_per_minute(stack: Stack) -> None:
    before = ledger(stack.sidecar, tenant="rpm")
    started = time.monotonic()
    for _ in range(2):
        assert_served(post(stack, "sk-rpm", completion()), "rpm")
    response = post(stack, "sk-rpm", completion())
    error = assert_rejected(response, 429, "rate_limited")
    assert error["type"] == "rate_limit_error"
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit(), retry_after
    # One request refills in 30 s at 2 a minute, less the time since the burst began.
    assert 30 - (time.monotonic() - started) - 1 <= int(retry_after) <= 30
    delta = settled(stack.sidecar, tenant="rpm") - before
    assert delta.arrived == 3 and delta.completed == 2 and delta.rejected == {"rate_limited": 1}


def test_endpoint_limits_apply_to_their_endpoint_only(stack: Stack) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_served(post(stack, "sk-endpoint", chat, "/v1/chat/completions"), "per-endpoint")
    response = post(stack, "sk-endpoint", chat, "/v1/chat/completions")
    assert_rejected(response, 429, "rate_limited")
    assert response.headers["retry-after"].isdigit()
    for _ in range(3):  # completions has no limit of its own
        assert_served(post(stack, "sk-endpoint", completion()), "per-endpoint")
    settled(stack.sidecar)


def test_model_limits_count_requests_naming_the_model_and_those_naming_none(
        stack: Stack) -> None:
    assert_served(post(stack, "sk-model", completion(model=SERVED)), "per-model")
    assert_served(post(stack, "sk-model", completion()), "per-model")  # the default model
    response = post(stack, "sk-model", completion(model=SERVED))
    assert_rejected(response, 429, "rate_limited")
    assert response.headers["retry-after"].isdigit()
    state = admin_state(stack.sidecar)["rate_limits"]["models"]["per-model"][SERVED]
    assert state["requests_per_minute"]["capacity"] == 2
    settled(stack.sidecar)


def test_a_request_that_can_never_fit_has_no_retry_after(stack: Stack) -> None:
    """prompt 4 + 200 output tokens exceed the whole 100-token bucket: waiting cannot help."""
    response = post(stack, "sk-tiny", completion(200))
    assert_rejected(response, 429, "rate_limited")
    assert "retry-after" not in response.headers
    assert "never fit" in response.json()["error"]["message"]
    assert_served(post(stack, "sk-tiny", completion(50)), "tiny")
    settled(stack.sidecar)


def bucket(stack: Stack, name: str) -> float:
    return admin_state(stack.sidecar)["rate_limits"]["tenants"][name]["tokens_per_minute"][
        "level"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_token_limit_settles_with_real_usage(stack: Stack, stream: bool) -> None:
    """The first request is charged its estimate (4 prompt + 256, the initial output
    estimate) at admission and settled to its real 4 + 400 at the end. The second asks for
    4 + 300: it fits the bucket as charged by estimates alone (600 - 260 = 340), but not
    after settlement (600 - 404 = 196, plus a few seconds of refill), so the 429 shows the
    settlement happened — for a streamed answer it can only come from the usage chunk."""
    name = f"tpm-{'stream' if stream else 'whole'}"
    key = f"sk-{name}"
    started = time.monotonic()
    response = post(stack, key, completion(400, stream=stream))
    assert_served(response, name)
    if stream:
        # The sidecar asked for usage on the client's behalf and dropped the usage chunk
        # again, since this client did not ask for it.
        assert '"usage"' not in response.text and response.text.endswith("data: [DONE]\n\n")
    else:
        assert response.json()["usage"]["completion_tokens"] == 400
    settled(stack.sidecar)
    level = bucket(stack, name)
    elapsed = time.monotonic() - started
    settled_level = TOKENS_PER_MINUTE - (4 + 400)
    assert settled_level - 1 <= level <= settled_level + REFILL_PER_S * elapsed + 1, (
        level, elapsed)

    response = post(stack, key, completion(300, stream=stream))
    error = assert_rejected(response, 429, "rate_limited")
    assert "tokens_per_minute" in error["message"]
    retry_after = int(response.headers["retry-after"])
    # (304 - level) / 10 tokens/s, rounded up.
    assert 1 <= retry_after <= (4 + 300 - settled_level) / REFILL_PER_S + 1
    # A request that fits what is left is admitted, and settles exactly again.
    response = post(stack, key, completion(100, stream=stream))
    assert_served(response, name)
    settled(stack.sidecar)
    elapsed = time.monotonic() - started
    level = bucket(stack, name)
    settled_level -= 4 + 100
    assert settled_level - 1 <= level <= settled_level + REFILL_PER_S * elapsed + 1


def test_stream_with_usage_requested_keeps_the_usage_chunk(stack: Stack) -> None:
    body = completion(5, stream=True, stream_options={"include_usage": True})
    response = post(stack, "sk-endpoint", body)
    assert_served(response, "per-endpoint")
    assert '"usage":{"prompt_tokens":4' in response.text.replace(" ", "")
    assert response.text.endswith("data: [DONE]\n\n")
