"""Three sidecar replicas sharing their state through a real redis-server, in front of one
emulated engine, as separate processes on loopback (issue 15's acceptance): limits hold
globally, a tenant's share is judged across replicas, a Redis outage costs no request and
no ledger entry, and a replica killed mid-run leaves the others' clients untouched."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.ledger import settled
from tests.support.limits import assert_within_the_limit, figures, hammer, ledger_figures
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import auth, completion, start_emulator, start_sidecar, tenant
from tests.support.wait import wait_for
from weighbridge.launch import ServerProcess

pytestmark = pytest.mark.timeout(180)

# Requests per minute of the global-limit tenant: a bucket of 120, refilled at 2 per second.
RPM = 120
# Tokens per minute of the token-limit tenant, and each of its requests' exact cost: a 4-token
# prompt and 16 tokens of output, which the endpoint's initial estimate also says.
TPM, TOKENS_PER_REQUEST = 2_400, 20


@dataclass
class Fleet:
    redis: RedisServer
    replicas: list[ServerProcess]
    engine: ServerProcess

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


@pytest.fixture(scope="module")
def fleet(processes: contextlib.ExitStack) -> Iterator[Fleet]:
    redis_server = processes.enter_context(RedisServer())
    engine = start_emulator(processes, max_num_seqs=64, num_kv_blocks=4096,
                            max_num_batched_tokens=2048)
    config = {
        "tenants": {
            "limited": tenant("standard", "sk-limited", limits={"requests_per_minute": RPM}),
            "tokens": tenant("standard", "sk-tokens", limits={"tokens_per_minute": TPM}),
            "restart": tenant("standard", "sk-restart", limits={"requests_per_minute": 30}),
            "steady": tenant("standard", "sk-steady"),
        },
        "endpoints": {"/v1/completions": {"initial_output_estimate": 16}},
        "backends": [{"url": engine.url}],
        "state": {"backend": "redis", "url": redis_server.url, "timeout_ms": 200,
                  "sync_ms": 50, "heartbeat_ms": 200},
    }
    replicas = [start_sidecar(processes, config) for _ in range(3)]
    fleet = Fleet(redis_server, replicas, engine)
    wait_for(lambda: all(scrape(u).value("weighbridge_shared_state_replicas") == 3
                         for u in fleet.urls) or None, 10, what="3 replicas registered")
    yield fleet


def test_requests_per_minute_hold_globally(fleet: Fleet) -> None:
    statuses, window = asyncio.run(hammer(fleet.urls, "sk-limited", 60, 5, completion(1)))
    assert set(statuses) <= {200, 429}, statuses
    allowed = RPM + RPM / 60 * window.send_s
    figures("requests_per_minute", limit_per_min=RPM, admitted=statuses[200],
            window_s=round(window.send_s, 3), allowed=round(allowed, 2),
            error_pct=round((statuses[200] - allowed) / allowed * 100, 2),
            statuses={str(k): v for k, v in statuses.items()})
    assert_within_the_limit(statuses[200], RPM, RPM / 60, window)
    for url in fleet.urls:
        settled(url)


def test_tokens_per_minute_hold_globally(fleet: Fleet) -> None:
    body = completion(16, prompt_tokens=4)
    statuses, window = asyncio.run(hammer(fleet.urls, "sk-tokens", 60, 5, body))
    assert set(statuses) <= {200, 429}, statuses
    allowed = (TPM + TPM / 60 * window.send_s) / TOKENS_PER_REQUEST
    figures("tokens_per_minute", limit_per_min=TPM, tokens_per_request=TOKENS_PER_REQUEST,
            admitted=statuses[200], admitted_tokens=statuses[200] * TOKENS_PER_REQUEST,
            window_s=round(window.send_s, 3), allowed=round(allowed, 2),
            error_pct=round((statuses[200] - allowed) / allowed * 100, 2),
            statuses={str(k): v for k, v in statuses.items()})
    assert_within_the_limit(statuses[200], TPM / TOKENS_PER_REQUEST,
                            TPM / 60 / TOKENS_PER_REQUEST, window)
    for url in fleet.urls:
        settled(url)


def test_redis_stopped_and_restarted_mid_run(fleet: Fleet) -> None:
    async def run() -> Counter[int]:
        load = asyncio.ensure_future(hammer(fleet.urls, "sk-steady", 30, 6, completion(4)))
        await asyncio.sleep(1.5)
        fleet.redis.stop()
        await asyncio.sleep(2)
        fleet.redis.start()
        statuses, _ = await load
        return statuses

    statuses = asyncio.run(run())
    five_xx = sum(v for k, v in statuses.items() if k >= 500)
    restart_statuses = {str(k): v for k, v in statuses.items()}
    assert statuses == Counter({200: statuses[200]}), statuses  # no 5xx, nothing refused
    ledgers = [settled(url) for url in fleet.urls]  # each replica's ledger adds up
    wait_for(lambda: all(scrape(u).value("weighbridge_shared_state_up") == 1
                         for u in fleet.urls) or None, 10, what="Redis reachable again")
    # Global again: 30 per minute across the three, not 30 (or 10) each. A replica whose
    # round trip times out during the burst falls back to a third of the level it last read
    # (by design, on a loaded machine): each such replica may admit up to 10 more, never a
    # fresh bucket's worth beyond what Redis had left (CI saw 34 once, before that rule).
    errors = [scrape(u).value("weighbridge_shared_state_errors_total") for u in fleet.urls]
    burst, _ = asyncio.run(hammer(fleet.urls, "sk-restart", 40, 1, completion(1)))
    fell_back = sum(scrape(u).value("weighbridge_shared_state_errors_total") > before
                    for u, before in zip(fleet.urls, errors, strict=True))
    figures("redis_restart", statuses=restart_statuses, five_xx=five_xx, sent=30 * 6,
            ledgers=ledger_figures(ledgers), burst_limit=30, burst_admitted=burst[200],
            burst_statuses={str(k): v for k, v in burst.items()}, fell_back=fell_back,
            burst_bound=[28, 32 + 10 * fell_back])
    assert 28 <= burst[200] <= 32 + 10 * fell_back, (burst, fell_back)


def test_a_replica_killed_under_load_leaves_the_others_alone(fleet: Fleet) -> None:
    survivors, victim = fleet.urls[:2], fleet.replicas[2]

    async def run() -> tuple[Counter[int], Counter[str]]:
        kept = asyncio.ensure_future(hammer(survivors, "sk-steady", 20, 4, completion(8)))
        cut: Counter[str] = Counter()

        async def doomed() -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                for _ in range(40):
                    try:
                        r = await c.post(victim.url + "/v1/completions",
                                         json=completion(32), headers=auth("sk-steady"))
                        cut[str(r.status_code)] += 1
                    except httpx.HTTPError as e:
                        cut[type(e).__name__] += 1
                        return

        lost = asyncio.ensure_future(doomed())
        await asyncio.sleep(1.0)
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        statuses, _ = await kept
        await lost
        return statuses, cut

    statuses, cut = asyncio.run(run())
    assert statuses == Counter({200: statuses[200]}), statuses
    assert sum(v for k, v in cut.items() if not k.isdigit()) == 1, cut  # its client saw it go
    ledgers = [settled(url) for url in survivors]  # conservation holds for the survivors
    figures("replica_killed", survivor_statuses={str(k): v for k, v in statuses.items()},
            survivor_failures=sum(v for k, v in statuses.items() if k != 200),
            victim_client=dict(cut), survivor_ledgers=ledger_figures(ledgers))
    # Its registration expires after 3 heartbeats: the survivors count 2.
    wait_for(lambda: all(scrape(u).value("weighbridge_shared_state_replicas") == 2
                         for u in survivors) or None, 10, what="the dead replica to expire")

