"""An engine is SIGKILLed under open-loop streaming load and restarted on its port while the
load goes on. Its clients get an error (an error event in the stream, or a 502 before the
first byte), new work goes to the surviving engine, the dead one is probed back when it
returns and takes work again, and the load generator's outcomes and the sidecar's ledger
agree request by request.

The same failure with a handful of hand-placed requests (which client sees what) is
tests/integration/sidecar/test_backend_faults.py; this is the same under running load.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.support.chaos import assert_conserved
from tests.support.driver import completion_body, poisson_times, session
from tests.support.driver import streamed_request as send_streamed
from tests.support.ledger import ledger, running, settled
from tests.support.metrics import scrape
from tests.support.stack import SMALL_ENGINE, start_sidecar, tenant
from tests.support.wait import await_for
from weighbridge.launch import ServerProcess, emulator_process, free_port

pytestmark = pytest.mark.timeout(120)

KEY = "sk-engine-loss"
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 16, "t_fixed": 0.01}  # 100 tokens/s per sequence
RATE = 12.0  # requests/s
KILL_AT, RESTART_AT, STOP_AT = 2.0, 4.5, 8.0
OUTPUT = 60  # tokens: 0.6 s per stream, so the kill catches several mid-stream


def healthy(sidecar: str, name: str) -> float:
    return scrape(sidecar).total("weighbridge_backend_healthy", backend=name)


async def test_engine_killed_and_restarted_under_load(processes) -> None:
    ports = {"a": free_port(), "b": free_port()}
    engines: dict[str, ServerProcess] = {}

    def start(name: str) -> None:
        engines[name] = emulator_process(name=f"engine-{name}", port=ports[name],
                                         **ENGINE).start()

    for name in ports:
        start(name)
    processes.callback(lambda: [p.stop() for p in engines.values()])
    sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("batch", KEY)},  # batch: no deadline, nothing turned away
        "backends": [{"url": f"http://127.0.0.1:{p}", "name": n} for n, p in ports.items()],
        "health_probe": {"interval_ms": 200, "timeout_ms": 1000},
        "admission": {"min_decode_tokens_per_s": 0, "max_backend_waiting": 100},
    }).url
    await await_for(lambda: healthy(sidecar, "a") == healthy(sidecar, "b") == 1)
    before = await asyncio.to_thread(ledger, sidecar)

    body = completion_body(16, OUTPUT, "weighbridge-emulator")
    times = poisson_times(RATE, STOP_AT, seed=8)
    t0 = time.monotonic() + 0.2

    async def chaos() -> tuple[float, float, float]:
        """When (seconds after t0) the sidecar was seen to have marked a down, before which
        a cannot have come back, and after which it was seen healthy again. Each is taken
        on the safe side of the event it stands for, however slow the machine."""
        await asyncio.sleep(t0 + KILL_AT - time.monotonic())
        engines["a"].signal(signal.SIGKILL)
        await await_for(lambda: healthy(sidecar, "a") == 0, what="a marked unhealthy")
        down = time.monotonic() - t0
        await asyncio.sleep(max(0.0, t0 + RESTART_AT - time.monotonic()))
        restarting = time.monotonic() - t0
        await asyncio.to_thread(engines["a"].stop)
        await asyncio.to_thread(start, "a")
        await await_for(lambda: healthy(sidecar, "a") == 1, what="a probed back")
        return down, restarting, time.monotonic() - t0

    async with session() as http:
        chaos_task = asyncio.create_task(chaos())
        outcomes = await asyncio.gather(*(
            send_streamed(http, sidecar + "/v1/completions", KEY, "t", body, at, t0)
            for at in times))
        down_at, restarting_at, back_at = await chaos_task
        # Once a is back, it takes work again: a burst of overlapping requests, more than
        # one engine's share, sent after the sidecar was seen to mark it healthy (on a slow
        # machine that can be after the load above ended).
        after_t0 = time.monotonic()
        returned = await asyncio.gather(*(
            send_streamed(http, sidecar + "/v1/completions", KEY, "t", body, 0.0, after_t0)
            for _ in range(2 * ENGINE["max_num_seqs"])))

    # The kill broke some requests on a, each seen by its client as an error.
    broken = [o for o in outcomes if not o.ok]
    assert broken, "the kill should have caught requests on a"
    for o in broken:
        assert o.backend == "a", o
        assert (o.status == 200 and "backend_failed" in (o.error or "")) or \
            (o.status == 502 and o.reject_reason == "backend_failed"), o
    # Requests dispatched while a was marked dead all went to b. A request is dispatched
    # between its scheduled send and its first token (or its end), so those whose whole
    # interval lies inside that time are the ones that must have gone to b.
    dead = [o.backend for o in outcomes if o.scheduled_s > down_at
            and (o.first_token_s if o.first_token_s is not None else o.end_s or 1e9)
            < restarting_at]
    assert dead and set(dead) == {"b"}, (dead, down_at, restarting_at)
    # After it returned, a works again.
    assert all(o.ok for o in returned), [o for o in returned if not o.ok][:3]
    assert "a" in {o.backend for o in returned}, {o.backend for o in returned}
    assert all(o.ok for o in outcomes if o.scheduled_s > back_at)

    delta = await asyncio.to_thread(settled, sidecar) - before
    seen = assert_conserved([*outcomes, *returned], delta)
    assert seen["failed"] == len(broken)
    for name in ports:
        assert await asyncio.to_thread(running, f"http://127.0.0.1:{ports[name]}") == 0
