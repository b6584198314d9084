"""1,100 clients walk away: 1,000 at once while they wait in the sidecar's queue, then the
100 whose answers stream ahead of them. The queue empties, the sidecar has nothing in
flight, the engine's running and waiting counts return to zero (every streamed request was
aborted there, no queued one ever reached it), and all 1,100 are counted cancelled, once
each.

Disconnects one at a time and a crowd of 25 are in
tests/integration/sidecar/test_queueing.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.ledger import admin_state, ledger, settled
from tests.support.metrics import scrape
from tests.support.raw_client import RawClient
from tests.support.stack import (
    ADMIN_KEY,
    SMALL_ENGINE,
    auth,
    completion,
    start_emulator,
    start_sidecar,
    tenant,
)
from tests.support.wait import await_for

pytestmark = pytest.mark.timeout(120)

STREAMING, QUEUED = 100, 1000
# 100 sequences decoding at 20 tokens/s each: the streams outlast the test.
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 128, "num_kv_blocks": 4096, "t_fixed": 0.05,
          "max_model_len": 4096}


def first_tokens(url: str) -> float:
    """Requests the engine has started answering (its TTFT histogram's count)."""
    return scrape(url).total("vllm:time_to_first_token_seconds_count")


def engine_busy(url: str) -> float:
    s = scrape(url)
    return s.total("vllm:num_requests_running") + s.total("vllm:num_requests_waiting")


async def test_eleven_hundred_clients_walk_away(processes) -> None:
    emulator = start_emulator(processes, **ENGINE)
    sidecar = start_sidecar(processes, {
        "tenants": {
            "streamer": tenant("standard", "sk-streamer"),
            # batch: no deadline, so a deep queue is kept, not turned away.
            "crowd": tenant("batch", "sk-crowd", limits={"max_queued": QUEUED}),
        },
        "backends": [{"url": emulator.url, "name": "engine"}],
        "admission": {"max_inflight_per_backend": STREAMING,
                      "max_running_per_backend": STREAMING, "max_backend_waiting": STREAMING,
                      "min_decode_tokens_per_s": 0},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }).url
    before = await asyncio.to_thread(ledger, sidecar)

    async def stream() -> RawClient:
        client = await RawClient.send(sidecar, "/v1/completions",
                                      completion(3000, stream=True), auth("sk-streamer"))
        assert (await client.read_head(timeout_s=60)).status == 200
        await client.read_until(b"data: {", timeout_s=60)
        return client

    streams = await asyncio.gather(*(stream() for _ in range(STREAMING)))
    await await_for(lambda: scrape(emulator.url).total("vllm:num_requests_running")
                    == STREAMING, timeout_s=30, what="every stream running")
    started = await asyncio.to_thread(first_tokens, emulator.url)
    queued = await asyncio.gather(*(
        RawClient.send(sidecar, "/v1/completions", completion(8), auth("sk-crowd"))
        for _ in range(QUEUED)))
    await await_for(lambda: ledger(sidecar, tenant="crowd").queued == QUEUED, timeout_s=60,
                    what="the crowd to queue")
    assert (await asyncio.to_thread(ledger, sidecar)).dispatched - before.dispatched \
        == STREAMING

    # Everyone leaves, half closing politely, half resetting the connection: the crowd
    # first, then the streams. (Had the streams gone first, a slot freed before the sidecar
    # read a queued client's goodbye could rightly be given to it.)
    for i, client in enumerate(queued):
        client.close() if i % 2 else client.abort()
    await await_for(lambda: ledger(sidecar).queued == 0, timeout_s=30,
                    what="the queue to empty")
    for i, client in enumerate(streams):
        client.close() if i % 2 else client.abort()
    await await_for(lambda: ledger(sidecar).dispatched == 0, timeout_s=30,
                    what="nothing in flight")
    await await_for(lambda: engine_busy(emulator.url) == 0, timeout_s=30,
                    what="the engine to abort every stream")
    delta = await asyncio.to_thread(settled, sidecar) - before
    assert delta.arrived == delta.cancelled == STREAMING + QUEUED, delta
    # None of the queued requests ever reached the engine.
    assert await asyncio.to_thread(first_tokens, emulator.url) == started
    state = await asyncio.to_thread(admin_state, sidecar)
    assert state["scheduler"]["queued"] == 0 and state["scheduler"]["queued_tokens"] == 0
    (backend,) = state["backends"].values()
    assert backend["inflight"] == 0 and backend["outstanding_tokens"] == 0

