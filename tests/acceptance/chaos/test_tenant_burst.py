"""One tenant bursts 10,000 requests at once while another sends a steady trickle. The
flooder's queue fills to its ``max_queued`` and the rest is turned away at once
(``queue_full``), so the sidecar's memory stays bounded by the queue limit, not by the
burst; the victim is never turned away and its latency holds; every request ends once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
import time

import aiohttp
import orjson
import pytest

from tests.support.chaos import assert_conserved, rss_bytes
from tests.support.driver import (
    Outcome,
    completion_body,
    poisson_times,
    session,
)
from tests.support.driver import streamed_request as send_streamed
from tests.support.ledger import ledger, settled
from tests.support.stack import SMALL_ENGINE, start_emulator, start_sidecar, tenant
from weighbridge.statistics import percentile

pytestmark = [pytest.mark.quiet, pytest.mark.timeout(180)]

BURST = 10_000
MAX_QUEUED = 200
# Memory the sidecar may add under the burst: 200 queued requests and a few hundred open
# connections are a few MiB; 10,000 held requests would be far more.
MAX_RSS_GROWTH = 64 << 20
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 16, "t_fixed": 0.005}
QUIET_S, FLOOD_S = 3.0, 8.0
# The flooder's open connections: at most this many of its requests are in the sidecar's
# intake at once, ahead of a victim request that arrives meanwhile.
FLOOD_CONNECTIONS = 1000


def _warm() -> None:
    pass


def flood_from_a_process(url: str, n: int, delay_s: float) -> tuple[list[Outcome], float]:
    """``n`` requests at once from the flooder, ``delay_s`` from now (run in a child
    process); their outcomes and how long the burst took."""

    async def burst() -> tuple[list[Outcome], float]:
        body = orjson.dumps({"prompt": [9] * 16, "max_tokens": 8, "ignore_eos": True})
        headers = {"authorization": "Bearer sk-flood", "content-type": "application/json"}
        out = [Outcome("flood", QUIET_S) for _ in range(n)]
        await asyncio.sleep(max(0.0, delay_s))
        started = time.monotonic()

        async def one(http: aiohttp.ClientSession, o: Outcome) -> None:
            async with http.post(url + "/v1/completions", data=body, headers=headers) as r:
                o.status = r.status
                o.reject_reason = r.headers.get("x-weighbridge-reject-reason")
                await r.read()
                o.end_s = time.monotonic() - started

        async with session(connections=FLOOD_CONNECTIONS) as http:
            await asyncio.gather(*(one(http, o) for o in out))
        return out, time.monotonic() - started

    return asyncio.run(burst())


async def test_a_tenant_bursting_ten_thousand_requests(processes) -> None:
    emulator = start_emulator(processes, **ENGINE)
    proc = start_sidecar(processes, {
        "tenants": {
            "flood": tenant("standard", "sk-flood", limits={"max_queued": MAX_QUEUED}),
            "victim": tenant("standard", "sk-victim"),
        },
        "backends": [{"url": emulator.url, "name": "engine"}],
        "admission": {"max_inflight_per_backend": 16, "headroom_slots": 4,
                      "max_backend_waiting": 8},
    })
    sidecar = proc.url
    assert proc.pid is not None
    before = await asyncio.to_thread(ledger, sidecar)
    rss_before = rss_bytes(proc.pid)
    peaks = {"rss": rss_before, "queued": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peaks["rss"] = max(peaks["rss"], rss_bytes(proc.pid))
            peaks["queued"] = max(peaks["queued"], ledger(sidecar, tenant="flood").queued)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    victim_body = completion_body(16, 8, "weighbridge-emulator")
    # The flood comes from its own process, so that sending it does not delay the victim's
    # client (on 2 cores, the 10,000-request client is as busy as the sidecar).
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        await loop.run_in_executor(pool, _warm)  # the child's imports, before the clock runs
        # The clock starts after them: started before, the victim's first requests were
        # scheduled in the past and their TTFT (from the scheduled instant) carried the
        # child's ~0.5 s start-up, the "quiet" p99 of 440-550 ms in ci11 and here.
        t0 = time.monotonic() + 0.2
        try:
            flood_task = loop.run_in_executor(pool, flood_from_a_process, sidecar, BURST,
                                              QUIET_S + t0 - time.monotonic())
            async with session() as victim_http:
                victim = await asyncio.gather(*(
                    send_streamed(victim_http, sidecar + "/v1/completions", "sk-victim",
                                  "victim", victim_body, at, t0)
                    for at in poisson_times(5.0, QUIET_S + FLOOD_S, seed=3)))
            flood, burst_s = await flood_task
        finally:
            stop.set()
            sampler.join(10)

    assert len(flood) == BURST
    # Turned away at once: by the queue bound, or (the flooder's own backlog past its tier's
    # 10 s deadline) by early rejection.
    assert {o.status for o in flood} <= {200, 429, 503}
    turned_away = [o for o in flood if o.status != 200]
    reasons = {o.reject_reason for o in turned_away}
    assert "queue_full" in reasons and reasons <= {"queue_full", "deadline_unmeetable"}
    assert len(turned_away) > BURST / 2, f"{len(turned_away)} turned away in {burst_s:.1f} s"
    # Bounded by the queue limit, not by the burst.
    assert peaks["queued"] <= MAX_QUEUED
    assert peaks["rss"] - rss_before < MAX_RSS_GROWTH, (rss_before, peaks)
    # The victim is never turned away, and its latency holds: its requests jump the
    # flooder's queue (DRR) into the headroom slots.
    assert all(o.ok for o in victim), [(o.status, o.reject_reason, o.error) for o in victim]
    quiet = sorted(o.ttft_s for o in victim if o.scheduled_s < QUIET_S)
    flooded = sorted(o.ttft_s for o in victim
                     if QUIET_S + 0.5 <= o.scheduled_s < QUIET_S + burst_s)
    assert quiet and flooded
    quiet_wait = percentile(sorted([o.queue_ms for o in victim if o.scheduled_s < QUIET_S]), 0.5)
    flooded_wait = percentile(sorted([o.queue_ms for o in victim
                               if QUIET_S + 0.5 <= o.scheduled_s < QUIET_S + burst_s]), 0.5)
    # Loose on purpose (2 busy cores run the sidecar, the engine and both clients): the
    # victim's median wait in the sidecar's queue stays bounded however long the flooder's
    # is. Measured 0.3 ms with the old hand-set admission, 100.5 ms with the first derived
    # defaults (one dispatch tick), 1-22 ms on 2026-12-02; the bound, two of the longest
    # ticks (250 ms), still fails if the victim queues behind the flood (seconds).
    assert flooded_wait < 2 * 250, (quiet_wait, flooded_wait)
    # The typical victim request keeps its latency: p50 TTFT under the burst within 5x the
    # quiet p99 (floor 200 ms), plus the intake ahead of it. Before the sidecar can tell a
    # victim request from a flood one it must read it, and the flooder keeps up to
    # FLOOD_CONNECTIONS requests in that intake, each costing the loop burst_s / BURST on
    # average (measured in this run, the turned-away ones included). Measured 32-124 ms; the
    # CI of stop 22 saw 1.04 s against the old bound of 1 s, which had no intake term (bursts
    # take 7.5-12 s here, an intake term of 0.75-1.2 s).
    intake_s = FLOOD_CONNECTIONS * burst_s / BURST
    quiet_p99 = max(percentile(quiet, 0.99), 0.2)
    assert percentile(flooded, 0.5) < 5 * quiet_p99 + intake_s, (intake_s, quiet, flooded)
    # Its tail shares the sidecar's one event loop with the burst's intake: 10,000 requests
    # read and answered (most turned away) in burst_s (7.5-8.8 s here, ~0.8 ms each with the
    # flooder's client on the other core), and a victim request arriving meanwhile waits
    # its turn among them before the scheduler sees it. So the bound on the tail is the
    # intake plus the quiet service, not the quiet service alone: measured p99 0.4-2.1 s
    # (queue wait p99 0.27-0.35 s, the dispatcher waiting for the loop). ci11 failed the
    # old bound (5x the quiet p99) at 2.7 s; it had passed only while the quiet p99 carried
    # the flood process's start-up (the clock started before it, fixed above).
    assert percentile(flooded, 0.99) < 5 * quiet_p99 + burst_s, (burst_s, quiet, flooded)

    delta = await asyncio.to_thread(settled, sidecar, 60) - before
    assert_conserved(list(victim) + flood, delta)
    assert delta.rejected_total == len(turned_away)
    print(f"burst of {BURST} in {burst_s:.1f} s: {len(turned_away)} turned away, peak RSS "
          f"+{(peaks['rss'] - rss_before) / 2**20:.1f} MiB, victim p50 queue wait "
          f"{quiet_wait:.1f} -> {flooded_wait:.1f} ms, p50 TTFT "
          f"{percentile(quiet, 0.5) * 1000:.0f} -> {percentile(flooded, 0.5) * 1000:.0f} ms "
          f"(bound {(5 * quiet_p99 + intake_s) * 1000:.0f}), p99 TTFT "
          f"{percentile(quiet, 0.99) * 1000:.0f} -> {percentile(flooded, 0.99) * 1000:.0f} ms")
