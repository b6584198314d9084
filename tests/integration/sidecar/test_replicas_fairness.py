"""Global fairness across sidecar replicas sharing their state through a real redis-server
(issue 15): two tenants of equal weight, both backlogged on one saturated engine; one sends
only through the first replica, the other through all three. Each gets about the same share of the
engine's output, where replicas judging alone would give the first tenant about the first
replica's third (the bound and the measured figures are at the assertion)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from tests.support.limits import closed_loop
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import start_emulator, start_sidecar, tenant
from tests.support.wait import wait_for
from weighbridge.statistics import jain_index

pytestmark = pytest.mark.timeout(180)

WARMUP_S, WINDOW_S = 4.0, 16.0
OUTPUT = 24


def test_a_tenant_s_share_is_judged_across_replicas(processes: contextlib.ExitStack) -> None:
    redis_server = processes.enter_context(RedisServer())
    # 8 sequences at 50 tokens/s each: 48 streams keep it saturated.
    engine = start_emulator(processes, max_num_seqs=8, t_fixed=0.02, num_kv_blocks=1024)
    config = {
        "tenants": {"one": tenant("standard", "sk-one", limits={"max_queued": 500}),
                    "spread": tenant("standard", "sk-spread", limits={"max_queued": 500})},
        "backends": [{"url": engine.url}],
        # The default sync_ms (10): shares are judged on the others' load as of the last sync.
        "state": {"backend": "redis", "url": redis_server.url, "timeout_ms": 50,
                  "heartbeat_ms": 200},
    }
    replicas = [start_sidecar(processes, config).url for _ in range(3)]
    wait_for(lambda: all(scrape(u).value("weighbridge_shared_state_replicas") == 3
                         for u in replicas) or None, 10, what="3 replicas registered")

    async def run() -> dict[str, list[tuple[float, int]]]:
        served: dict[str, list[tuple[float, int]]] = {"one": [], "spread": []}
        start = time.monotonic()
        until = start + WARMUP_S + WINDOW_S
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            # Enough clients that each tenant stays backlogged on every replica it uses (8
            # each on the spread tenant's three): a tenant with nothing queued somewhere is
            # not starved there, and the share rule rightly lets the other run ahead.
            clients = [closed_loop(c, replicas[0], "sk-one", until, served["one"], OUTPUT, 16)
                       for _ in range(24)]
            clients += [closed_loop(c, replicas[i % 3], "sk-spread", until, served["spread"],
                                   OUTPUT, 16)
                        for i in range(24)]
            await asyncio.gather(*clients)
        window = (start + WARMUP_S, until)
        return {name: [(t, n) for t, n in answers if window[0] <= t <= window[1]]
                for name, answers in served.items()}

    served = asyncio.run(run())
    tokens = {name: sum(n for _, n in answers) for name, answers in served.items()}
    assert all(tokens.values()), tokens
    index = jain_index(list(tokens.values()))
    share = tokens["one"] / sum(tokens.values())
    print(f"\noutput tokens in the window: {tokens}; Jain {index:.3f}")
    print("FIGURES " + json.dumps({"test": "fairness", "tokens": tokens,
                                   "share_one": round(share, 4), "jain": round(index, 4)}))
    # Judging alone, each replica would give "one" about its replica's third of the engine
    # (Jain 0.90). Issue 15 asks for Jain >= 0.98, i.e. each tenant within 0.43-0.57 of the
    # tokens. Measured with global shares, the rule binding in headroom as well (2026-12-02,
    # 12 runs beside other work, load ~1): Jain 0.995-1.000, "one" 0.46-0.50. Before the
    # rule bound in headroom, a replica's work-conserving headroom let "one" take 0.60-0.66
    # in a third of the runs.
    assert index >= 0.98, (tokens, share)
