"""An engine slows down tenfold at run time (the emulator's ``POST /admin/slowdown``) under
a load it served comfortably before. Admission holds the excess upstream (the engine's own
waiting queue stays short while the sidecar's grows), early rejection starts turning away
requests whose deadline the backlog makes unmeetable, and the interactive tier keeps being
served first: it is never turned away and waits far less than the flooded tier. When the
engine recovers, the backlog drains and every request has ended exactly once, as its
client saw it.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from tests.support import loopback
from tests.support.chaos import assert_conserved, set_slowdown
from tests.support.driver import (
    Outcome,
    completion_body,
    poisson_times,
    session,
)
from tests.support.driver import streamed_request as send_streamed
from tests.support.ledger import ledger, settled
from tests.support.metrics import scrape
from tests.support.stack import SMALL_ENGINE, start_emulator, start_sidecar, tenant
from weighbridge.statistics import percentile

pytestmark = pytest.mark.timeout(120)

# 8 sequences at 100 tokens/s each: ~800 output tokens/s, ~80 after the slowdown.
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 8, "t_fixed": 0.01}
SLOW_AT, RECOVER_AT, STOP_AT = 3.0, 9.0, 9.0
BULK_RATE, GOLD_RATE = 8.0, 2.0  # requests/s: 8 x 40 = 320 output tokens/s of bulk
BULK_DEADLINE_MS = "3000"
MAX_BACKEND_WAITING = 2


async def test_engine_slowed_tenfold(processes) -> None:
    emulator = start_emulator(processes, **ENGINE)
    sidecar = start_sidecar(processes, {
        "tenants": {
            "gold": tenant("interactive", "sk-gold"),
            "bulk": tenant("standard", "sk-bulk", limits={"max_queued": 500}),
        },
        "backends": [{"url": emulator.url, "name": "engine"}],
        "admission": {"max_inflight_per_backend": 8, "headroom_slots": 2,
                      "max_backend_waiting": MAX_BACKEND_WAITING, "metrics_poll_ms": 100},
    }).url
    before = await asyncio.to_thread(ledger, sidecar)
    holds_before = (await asyncio.to_thread(scrape, sidecar)).total(
        "weighbridge_admission_holds_total")
    t0 = time.monotonic() + 0.2
    bulk_body = completion_body(16, 40, "weighbridge-emulator")
    gold_body = completion_body(16, 8, "weighbridge-emulator")
    engine_waiting: list[float] = []
    sidecar_queued: list[int] = []

    async def watch() -> None:
        """Samples both queues while the engine is slow."""
        await asyncio.sleep(t0 + SLOW_AT + 1 - time.monotonic())
        while time.monotonic() - t0 < RECOVER_AT:
            engine_waiting.append((await asyncio.to_thread(scrape, emulator.url)).total(
                "vllm:num_requests_waiting"))
            sidecar_queued.append((await asyncio.to_thread(ledger, sidecar)).queued)
            await asyncio.sleep(0.2)

    async def chaos() -> None:
        await asyncio.sleep(t0 + SLOW_AT - time.monotonic())
        await asyncio.to_thread(set_slowdown, emulator.url, 10)
        await asyncio.sleep(t0 + RECOVER_AT - time.monotonic())
        await asyncio.to_thread(set_slowdown, emulator.url, 1)

    async with session() as http:
        def bulk(at: float) -> asyncio.Task[Outcome]:
            return asyncio.create_task(send_streamed(
                http, sidecar + "/v1/completions", "sk-bulk", "bulk", bulk_body, at, t0,
                {"x-weighbridge-deadline-ms": BULK_DEADLINE_MS}))

        def gold(at: float) -> asyncio.Task[Outcome]:
            return asyncio.create_task(send_streamed(
                http, sidecar + "/v1/completions", "sk-gold", "gold", gold_body, at, t0))

        background = [asyncio.create_task(chaos()), asyncio.create_task(watch())]
        bulk_tasks = [bulk(at) for at in poisson_times(BULK_RATE, STOP_AT, seed=1)]
        gold_tasks = [gold(at) for at in poisson_times(GOLD_RATE, STOP_AT, seed=2)]
        bulk_out = await asyncio.gather(*bulk_tasks)
        gold_out = await asyncio.gather(*gold_tasks)
        await asyncio.gather(*background)

    def phase(outs: list[Outcome], lo: float, hi: float) -> list[Outcome]:
        return [o for o in outs if lo <= o.scheduled_s < hi]

    # Before the slowdown the load fits: nothing is turned away.
    assert all(o.ok for o in phase(bulk_out + gold_out, 0, SLOW_AT)), \
        collections.Counter(o.reject_reason for o in phase(bulk_out, 0, SLOW_AT))
    # Slowed: the bulk tier's backlog makes its deadline unmeetable, and it is told at once.
    slow_bulk = phase(bulk_out, SLOW_AT + 1, RECOVER_AT)
    rejected = [o for o in slow_bulk if o.status == 503]
    assert rejected, "deadline rejections should start while the engine is slow"
    assert {o.reject_reason for o in rejected} == {"deadline_unmeetable"}
    # Held upstream: the sidecar's queue grew, the engine's stayed near its target.
    assert max(sidecar_queued) > 3 * MAX_BACKEND_WAITING, sidecar_queued
    assert max(engine_waiting) <= MAX_BACKEND_WAITING + 3, engine_waiting
    holds = (await asyncio.to_thread(scrape, sidecar)).total(
        "weighbridge_admission_holds_total")
    assert holds > holds_before
    # Tier 1 first: gold is never turned away and waits far less than bulk in the sidecar.
    assert all(o.ok for o in gold_out), [(o.status, o.reject_reason) for o in gold_out]
    gold_wait = percentile(sorted([o.queue_ms for o in phase(gold_out, SLOW_AT + 1, RECOVER_AT)
                            if o.queue_ms is not None]), 0.5)
    # The bulk requests that were admitted into the growing backlog (later ones are turned
    # away) and waited it out.
    waited = [o.queue_ms for o in phase(bulk_out, SLOW_AT - 0.5, RECOVER_AT)
              if o.ok and o.queue_ms is not None]
    assert waited
    bulk_wait = percentile(sorted(waited), 0.5)
    assert gold_wait < bulk_wait / 3, (gold_wait, bulk_wait)

    delta = await asyncio.to_thread(settled, sidecar, 60) - before
    assert_conserved(bulk_out + gold_out, delta)
    assert delta.rejected == {"deadline_unmeetable": len(rejected) + sum(
        o.status == 503 for o in bulk_out if o not in slow_bulk)}


@pytest.fixture(scope="module")
def idle_emulator(processes) -> str:
    return start_emulator(processes).url


@pytest.mark.parametrize("body", [b"", b"[]", b'{"factor": 0}', b'{"factor": -2}',
                                  b'{"factor": "10"}', b'{"factor": true}', b'{"speed": 2}',
                                  b'{"factor": 1e999}'])
def test_slowdown_knob_rejects_bad_factors(idle_emulator: str, body: bytes) -> None:
    response = loopback.post(idle_emulator + "/admin/slowdown", content=body, timeout=10)
    assert response.status_code == 400, response.text
    assert "factor" in response.json()["error"]["message"]
