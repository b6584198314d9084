"""Two ``weighbridge epp`` replicas behind one Envoy, sharing their state through a real
redis-server as the sidecar's replicas do (``state.backend: redis``): Envoy sends each
request's ext_proc stream to one of them, round robin, and a tenant's global limit holds
across both, active-active."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.support.ledger import ledger, settled
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import auth, completion, start_emulator, tenant
from tests.support.wait import wait_for
from weighbridge.launch import envoy_config, envoy_process, epp_process, free_port

pytestmark = pytest.mark.timeout(120)

LIMIT = 10  # requests a minute, for the tenant the test spends


def test_a_global_limit_holds_across_two_pickers(processes: contextlib.ExitStack) -> None:
    redis_server = processes.enter_context(RedisServer())
    engine = start_emulator(processes)
    config = {
        "tenants": {"t": tenant("standard", "sk-t",
                                limits={"requests_per_minute": LIMIT})},
        "backends": [{"url": engine.url}],
        "state": {"backend": "redis", "url": redis_server.url, "timeout_ms": 2_000,
                  "heartbeat_ms": 200},
    }
    pickers = []
    for _ in range(2):
        picker, grpc_port = epp_process(config)
        processes.enter_context(picker)
        pickers.append((picker, grpc_port))
    wait_for(lambda: all(scrape(p.url).value("weighbridge_shared_state_replicas") == 2
                         for p, _ in pickers) or None, 15, what="both pickers registered")
    port, admin = free_port(), free_port()
    envoy = processes.enter_context(envoy_process(
        envoy_config(port, admin, [("127.0.0.1", g) for _, g in pickers]), port, admin))
    sent = 3 * LIMIT
    started = time.monotonic()
    with httpx.Client(timeout=30) as client:
        statuses = [client.post(envoy.url + "/v1/completions", json=completion(2),
                                headers=auth("sk-t")).status_code for _ in range(sent)]
    elapsed = time.monotonic() - started
    served = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    # The bucket holds LIMIT and refills LIMIT a minute: over the run it may have refilled
    # elapsed / 60 * LIMIT more, and its last fraction may complete one request (+1). Two
    # pickers judging apart would each have let LIMIT through.
    assert LIMIT <= served <= LIMIT + int(elapsed / 60 * LIMIT) + 1, (served, elapsed)
    arrived = [settled(p.url).arrived for p, _ in pickers]
    assert sum(arrived) == sent and min(arrived) >= sent // 4, arrived  # both took streams
    assert sum(ledger(p.url).completed for p, _ in pickers) == served
