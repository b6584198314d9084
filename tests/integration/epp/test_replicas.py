"""Two ``weighbridge epp`` replicas behind one Envoy, sharing their state through a real
redis-server as the sidecar's replicas do (``state.backend: redis``): Envoy sends each
request's ext_proc stream to one of them, round robin, active-active (issue 42's
acceptance). A tenant's requests and tokens a minute hold across both within 2% of the
configured values; one picker SIGKILLed mid-run ends every client's request once (its
answer, or a clear error), the survivor serves the rest, and its ledger balances. The 4:1
weighted share across both is test_replicas_share.py. Each test prints one FIGURES line
(benchmarks/epp_replicas.py repeats them)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.ledger import ledger, running, settled
from tests.support.limits import assert_within_the_limit, figures, hammer, ledger_figures
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import auth, completion, start_emulator, tenant
from tests.support.wait import wait_for
from weighbridge.launch import ServerProcess, envoy_config, envoy_process, epp_process, free_port

pytestmark = pytest.mark.timeout(180)

# Requests per minute of the global-limit tenant: a bucket of 120, refilled at 2 per second.
RPM = 120
# Tokens per minute of the token-limit tenant, and each of its requests' exact cost: a 4-token
# prompt and 16 tokens of output, which the endpoint's initial estimate also says.
TPM, TOKENS_PER_REQUEST = 2_400, 20


@dataclass
class Gateway:
    url: str  # Envoy's listener
    pickers: list[ServerProcess]
    engine: ServerProcess

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.pickers]


@pytest.fixture(scope="module")
def gateway(processes: contextlib.ExitStack) -> Iterator[Gateway]:
    redis_server = processes.enter_context(RedisServer())
    engine = start_emulator(processes, max_num_seqs=64, num_kv_blocks=4096,
                            max_num_batched_tokens=2048)
    config = {
        "tenants": {
            "limited": tenant("standard", "sk-limited", limits={"requests_per_minute": RPM}),
            "tokens": tenant("standard", "sk-tokens", limits={"tokens_per_minute": TPM}),
            "steady": tenant("standard", "sk-steady"),
        },
        "endpoints": {"/v1/completions": {"initial_output_estimate": 16}},
        "backends": [{"url": engine.url}],
        "state": {"backend": "redis", "url": redis_server.url, "timeout_ms": 200,
                  "sync_ms": 50, "heartbeat_ms": 200},
    }
    pickers = []
    for i in range(2):
        picker, grpc_port = epp_process(config, name=f"epp-{i}")
        processes.enter_context(picker)
        pickers.append((picker, grpc_port))
    wait_for(lambda: all(scrape(p.url).value("weighbridge_shared_state_replicas") == 2
                         for p, _ in pickers) or None, 15, what="both pickers registered")
    port, admin = free_port(), free_port()
    envoy = processes.enter_context(envoy_process(
        envoy_config(port, admin, [("127.0.0.1", g) for _, g in pickers]), port, admin))
    yield Gateway(envoy.url, [p for p, _ in pickers], engine)


def test_requests_per_minute_hold_globally(gateway: Gateway) -> None:
    """60 requests a second for 5 s through Envoy, which spreads them over both pickers: the
    bucket's 120 plus its refill over the window admitted once, not once per picker."""
    before = [settled(u).arrived for u in gateway.urls]
    statuses, window = asyncio.run(hammer([gateway.url], "sk-limited", 60, 5, completion(1)))
    assert set(statuses) <= {200, 429}, statuses
    allowed = RPM + RPM / 60 * window.send_s
    arrived = [settled(u).arrived - b for u, b in zip(gateway.urls, before, strict=True)]
    figures("requests_per_minute", limit_per_min=RPM, admitted=statuses[200],
            window_s=round(window.send_s, 3), allowed=round(allowed, 2),
            error_pct=round((statuses[200] - allowed) / allowed * 100, 2),
            statuses={str(k): v for k, v in statuses.items()}, per_picker=arrived)
    assert sum(arrived) == 300 and min(arrived) >= 300 // 4, arrived  # both took streams
    assert_within_the_limit(statuses[200], RPM, RPM / 60, window)


def test_tokens_per_minute_hold_globally(gateway: Gateway) -> None:
    body = completion(16, prompt_tokens=4)
    statuses, window = asyncio.run(hammer([gateway.url], "sk-tokens", 60, 5, body))
    assert set(statuses) <= {200, 429}, statuses
    allowed = (TPM + TPM / 60 * window.send_s) / TOKENS_PER_REQUEST
    figures("tokens_per_minute", limit_per_min=TPM, tokens_per_request=TOKENS_PER_REQUEST,
            admitted=statuses[200], admitted_tokens=statuses[200] * TOKENS_PER_REQUEST,
            window_s=round(window.send_s, 3), allowed=round(allowed, 2),
            error_pct=round((statuses[200] - allowed) / allowed * 100, 2),
            statuses={str(k): v for k, v in statuses.items()})
    assert_within_the_limit(statuses[200], TPM / TOKENS_PER_REQUEST,
                            TPM / 60 / TOKENS_PER_REQUEST, window)
    for url in gateway.urls:
        settled(url)


def test_a_picker_killed_mid_run(gateway: Gateway) -> None:
    """Last in the module. 20 streams a second for 6 s through Envoy; after 2 s one picker
    is SIGKILLed. Every client's request ends once, none hangs (the client's timeout bounds
    each): its answer, Envoy's 500 for a stream the dead picker held or took before Envoy
    ejected it, or a stream cut mid-body. The survivor's ledger balances and ends with
    nothing queued or in flight, the engine's sequences all end, and requests sent once
    Envoy has ejected the dead picker are all served."""
    survivor, victim = gateway.pickers

    async def run() -> Counter[str]:
        ends: Counter[str] = Counter()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) \
                as client:
            async def one() -> None:
                try:
                    async with client.stream("POST", gateway.url + "/v1/completions",
                                             json=completion(40, stream=True),
                                             headers=auth("sk-steady")) as response:
                        async for _ in response.aiter_bytes():
                            pass
                        ends[str(response.status_code)] += 1
                except httpx.HTTPError as e:  # a stream cut off mid-body: a clear error
                    ends[type(e).__name__] += 1

            async def load() -> None:
                tasks = []
                for _ in range(120):
                    tasks.append(asyncio.ensure_future(one()))
                    await asyncio.sleep(0.05)
                await asyncio.gather(*tasks)

            running_load = asyncio.ensure_future(load())
            await asyncio.sleep(2.0)
            victim.signal(signal.SIGKILL)
            await running_load
        return ends

    before = ledger(survivor.url)
    ends = asyncio.run(run())
    assert sum(ends.values()) == 120, ends  # every request ended, once
    assert set(ends) <= {"200", "500", "RemoteProtocolError", "ReadError"}, ends
    after = settled(survivor.url)  # balanced: arrived = completed + rejected + ...
    assert after.queued == after.dispatched == 0
    wait_for(lambda: running(gateway.engine.url) == 0, 30, what="the engine idle")
    # Once Envoy has ejected the dead picker (its health check, every second), nothing fails.
    with httpx.Client(timeout=30) as client:
        statuses = Counter(client.post(gateway.url + "/v1/completions", json=completion(2),
                                       headers=auth("sk-steady")).status_code
                           for _ in range(20))
    figures("picker_killed", ends=dict(ends), survivor_ledger=ledger_figures([after - before]),
            after_ejection={str(k): v for k, v in statuses.items()})
    assert statuses == Counter({200: 20}), statuses
