"""vLLM's pooling endpoints through the sidecar process, in front of an emulator process, on
loopback: every path of /rerank, /score, /pooling and /classify is served and settled in
the ledger; the tenant is charged the input tokens the engine computed (the sidecar's
served prompt tokens, the tenant's token bucket and the engine's vllm:prompt_tokens agree),
nothing generated."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from tests.support import loopback
from tests.support.answers import assert_served
from tests.support.ledger import admin_state, ledger, settled
from tests.support.metrics import scrape
from tests.support.stack import ADMIN_KEY, Stack, auth, start_stack, tenant
from weighbridge.endpoints import EndpointKind

pytestmark = pytest.mark.timeout(120)

KEY = "sk-pooling"
TOKENS_PER_DAY = 1_000_000
BODIES: dict[EndpointKind, dict[str, Any]] = {
    EndpointKind.RERANK: {"query": "first train", "documents": ["the 8:05", "a map", "tea"]},
    EndpointKind.SCORE: {"queries": ["a", "b"], "documents": ["c", "d"]},
    EndpointKind.POOLING: {"input": [[9] * 20, [10] * 7]},
    EndpointKind.CLASSIFY: {"input": "classify me", "priority": 3},
}


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    return start_stack(processes, {
        "tenants": {"t": tenant("standard", KEY, limits={"tokens_per_day": TOKENS_PER_DAY})},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })


def test_every_path_is_served_and_charged_what_the_engine_computed(stack: Stack) -> None:
    started = time.monotonic()
    before, engine_before = ledger(stack.sidecar), scrape(stack.emulator)
    sidecar_before = scrape(stack.sidecar)
    usage = 0
    sent = 0
    for kind, body in BODIES.items():
        for path in kind.paths:
            response = loopback.post(stack.sidecar + path, json=body, headers=auth(KEY),
                                     timeout=30)
            assert_served(response, "t")
            answer = response.json()
            assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] > 0
            usage += answer["usage"]["prompt_tokens"]
            sent += 1
    delta = settled(stack.sidecar) - before
    assert delta.arrived == delta.completed == sent and delta.rejected_total == 0
    after, engine_after = scrape(stack.sidecar), scrape(stack.emulator)

    def grown(s0: Any, s1: Any, name: str, **labels: str) -> float:
        return s1.total(name, **labels) - s0.total(name, **labels)

    assert grown(sidecar_before, after, "weighbridge_tokens_served_total", tenant="t",
                 kind="prompt") == usage
    assert grown(sidecar_before, after, "weighbridge_tokens_served_total", tenant="t",
                 kind="output") == 0
    assert grown(engine_before, engine_after, "vllm:prompt_tokens_total") == usage
    assert grown(engine_before, engine_after, "vllm:generation_tokens_total") == 0
    bucket = admin_state(stack.sidecar)["rate_limits"]["tenants"]["t"]["tokens_per_day"]
    # Charged the usage, less what the day's bucket refilled meanwhile (at most the elapsed
    # time's share of a day: the margin, derived, not a timing).
    refilled = TOKENS_PER_DAY * (time.monotonic() - started) / 86_400
    assert TOKENS_PER_DAY - usage - 1e-6 <= bucket["level"] <= TOKENS_PER_DAY - usage + refilled
