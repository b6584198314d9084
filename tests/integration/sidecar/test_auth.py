"""Who a request belongs to: the bearer key alone decides the tenant, the admin key alone
opens /admin/state, and a request may step down its tenant's tier but never up."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.support import loopback
from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import admin_state, ledger, settled
from tests.support.metrics import scrape
from tests.support.raw_client import RawClient
from tests.support.stack import (
    ADMIN_KEY,
    Stack,
    auth,
    completion,
    start_stack,
    tenant,
)
from tests.support.wait import await_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    # 50 tokens/s per sequence: a 200-token stream lasts long enough to look at it in flight.
    return start_stack(processes, {
        "tenants": {
            "gold": tenant("interactive", "sk-gold"),
            "silver": tenant("standard", "sk-silver"),
        },
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }, t_fixed=0.02)


@pytest.mark.parametrize("headers", [
    {},
    {"authorization": "Bearer sk-nobody"},
    {"authorization": "Bearer"},
    {"authorization": "Basic c2stZ29sZDo="},
    {"authorization": "sk-gold"},
    {"authorization": "Bearer sk-gold-but-longer"},
    {"authorization": f"Bearer {ADMIN_KEY}"},  # the admin key is not a tenant key
], ids=["missing", "unknown", "empty", "basic", "no-scheme", "prefix", "admin-key"])
def test_missing_or_invalid_key_is_401(stack: Stack, headers: dict[str, str]) -> None:
    before = ledger(stack.sidecar)
    response = loopback.post(stack.sidecar + "/v1/completions", json=completion(),
                          headers=headers, timeout=10)
    error = assert_rejected(response, 401, "unauthorized")
    assert error["type"] == "authentication_error"
    assert "x-weighbridge-tenant" not in response.headers
    delta = settled(stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {"unauthorized": 1}
    # Counted under the unauthenticated label, never under a tenant.
    assert ledger(stack.sidecar, tenant="unauthenticated").rejected["unauthorized"] >= 1


def test_chat_endpoint_and_models_need_a_key(stack: Stack) -> None:
    response = loopback.post(stack.sidecar + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert_rejected(response, 401, "unauthorized")
    response = loopback.get(stack.sidecar + "/v1/models", timeout=10)
    assert_rejected(response, 401, "unauthorized")
    response = loopback.get(stack.sidecar + "/v1/models", headers=auth("sk-gold"), timeout=10)
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "weighbridge-emulator"
    settled(stack.sidecar)


def test_admin_state_needs_the_admin_key(stack: Stack) -> None:
    url = stack.sidecar + "/admin/state"
    assert_rejected(loopback.get(url, timeout=10), 401, "unauthorized")
    assert_rejected(loopback.get(url, headers=auth("sk-wrong"), timeout=10), 401, "unauthorized")
    error = assert_rejected(loopback.get(url, headers=auth("sk-gold"), timeout=10), 403,
                            "forbidden")
    assert error["type"] == "permission_error"
    state = admin_state(stack.sidecar)
    assert {"scheduler", "rate_limits", "backends", "ledger"} <= set(state)


async def test_admin_state_shows_queues_deficits_buckets_and_backends(stack: Stack) -> None:
    # A stream in flight makes gold an active tenant, with a deficit and a queue entry.
    client = await RawClient.send(stack.sidecar, "/v1/completions",
                                  completion(200, stream=True), auth("sk-gold"))
    try:
        assert (await client.read_head()).status == 200
        await client.read_until(b"data: {")
        state = await asyncio.to_thread(admin_state, stack.sidecar)
        gold = state["scheduler"]["tenants"]["gold"]
        assert gold["inflight"] == 1 and gold["tier"] == "interactive"
        assert "interactive" in gold["deficit_turns"]
        assert "queues" in gold and state["scheduler"]["policy"] == "drr"
        # gold has no rate limit: no bucket of its own ("every bucket in use").
        assert set(state["rate_limits"]) == {"tenants", "endpoints", "models", "tiers"}
        assert "gold" not in state["rate_limits"]["tenants"]
        (backend,) = state["backends"].values()
        assert backend["healthy"] is True and backend["url"] == stack.emulator
        assert backend["inflight"] == 1 and backend["gate"]["cap"] >= 1
        assert state["ledger"]["total"]["dispatched"] == 1
    finally:
        client.close()
    await await_for(lambda: ledger(stack.sidecar).dispatched == 0, what="the stream to end")


def test_spoofed_tenant_header_is_ignored(stack: Stack) -> None:
    before_gold = ledger(stack.sidecar, tenant="gold")
    before_silver = ledger(stack.sidecar, tenant="silver")
    response = loopback.post(stack.sidecar + "/v1/completions", json=completion(),
                          headers={**auth("sk-silver"), "x-weighbridge-tenant": "gold"},
                          timeout=10)
    assert_served(response, "silver")
    settled(stack.sidecar)
    assert ledger(stack.sidecar, tenant="gold") == before_gold
    delta = ledger(stack.sidecar, tenant="silver") - before_silver
    assert delta.arrived == delta.completed == 1


def test_higher_tier_is_forbidden(stack: Stack) -> None:
    before = ledger(stack.sidecar, tenant="silver")
    response = loopback.post(stack.sidecar + "/v1/completions", json=completion(),
                          headers={**auth("sk-silver"), "x-weighbridge-tier": "interactive"},
                          timeout=10)
    error = assert_rejected(response, 403, "tier_not_allowed")
    assert error["type"] == "permission_error"
    delta = settled(stack.sidecar, tenant="silver") - before
    assert delta.arrived == 1 and delta.rejected == {"tier_not_allowed": 1}


def test_unknown_tier_is_400(stack: Stack) -> None:
    response = loopback.post(stack.sidecar + "/v1/completions", json=completion(),
                          headers={**auth("sk-gold"), "x-weighbridge-tier": "platinum"},
                          timeout=10)
    assert_rejected(response, 400, "unknown_tier")
    settled(stack.sidecar)


@pytest.mark.parametrize("stream", [False, True])
def test_lower_tier_is_accepted_and_runs_there(stack: Stack, stream: bool) -> None:
    before_batch = ledger(stack.sidecar, tenant="gold", tier="batch")
    before_own = ledger(stack.sidecar, tenant="gold", tier="interactive")
    response = loopback.post(stack.sidecar + "/v1/completions", json=completion(stream=stream),
                          headers={**auth("sk-gold"), "x-weighbridge-tier": "batch"},
                          timeout=10)
    assert_served(response, "gold")
    settled(stack.sidecar)
    delta = ledger(stack.sidecar, tenant="gold", tier="batch") - before_batch
    assert delta.arrived == delta.completed == 1
    assert ledger(stack.sidecar, tenant="gold", tier="interactive") == before_own
    # The queue-wait histogram carries the tier it ran in.
    assert scrape(stack.sidecar).total("weighbridge_queue_wait_seconds_count", tier="batch") >= 1


def test_keys_and_prompts_are_never_shown(stack: Stack) -> None:
    """Neither a key (good or mistyped) nor a prompt appears in the log, /admin/state or
    /metrics."""
    marker = "PROMPT-MARKER-7f3a"
    response = loopback.post(stack.sidecar + "/v1/completions",
                          json={"prompt": marker, "max_tokens": 2},
                          headers=auth("sk-gold"), timeout=10)
    assert_served(response, "gold")
    response = loopback.post(stack.sidecar + "/v1/completions",
                          json={"prompt": marker, "max_tokens": 2},
                          headers=auth("sk-typo-secret"), timeout=10)
    assert_rejected(response, 401, "unauthorized")
    state = loopback.get(stack.sidecar + "/admin/state", headers=auth(ADMIN_KEY), timeout=10).text
    metrics = loopback.get(stack.sidecar + "/metrics", timeout=10).text
    log = stack.log.read_text(errors="replace")
    for text in (state, metrics, log):
        for secret in ("sk-gold", "sk-silver", "sk-typo-secret", ADMIN_KEY, marker):
            assert secret not in text


def test_healthz_and_readyz(stack: Stack) -> None:
    assert loopback.get(stack.sidecar + "/healthz", timeout=10).status_code == 200
    response = loopback.get(stack.sidecar + "/readyz", timeout=10)
    assert response.status_code == 200 and response.json() == {"ready": True}
