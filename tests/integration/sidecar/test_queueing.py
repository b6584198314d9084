"""The upstream queue's edges: bounded queues (``queue_full``), early rejection
(``deadline_unmeetable``, decided at once), and clients that go away — while queued (the
request leaves the queue at once and never reaches a backend) or while their answer is
being produced (the backend request is aborted).

The sidecar admits one request at a time to the backend (``max_inflight_per_backend: 1``),
and a *holder* — a long stream from its own tenant — keeps that slot busy, so everything
else the tests send waits in the sidecar's queue for as long as the test wants.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import admin_state, backend_finished, ledger, running, settled
from tests.support.metrics import scrape
from tests.support.raw_client import RawClient
from tests.support.stack import (
    ADMIN_KEY,
    Stack,
    auth,
    completion,
    start_sidecar,
    start_stack,
    tenant,
)
from tests.support.stub_backend import StubBackend
from tests.support.wait import await_for

pytestmark = pytest.mark.timeout(60)

CROWD = 25


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    # 20 tokens/s per sequence: the holder's 2,000-token stream outlasts every test.
    return start_stack(processes, {
        "tenants": {
            "holder": tenant("batch", "sk-holder"),
            "small": tenant("standard", "sk-small", limits={"max_queued": 2}),
            # batch: no SLO. At 20 tokens/s a 256- or 1,000-token answer passes standard's
            # 10 s end-to-end deadline, so it would be turned away at arrival.
            "small-tokens": tenant("batch", "sk-small-tokens",
                                   limits={"max_queued_tokens": 300}),
            "backlog": tenant("standard", "sk-backlog"),
            "hurry": tenant("standard", "sk-hurry"),
            # batch: no SLO, so a deep queue is not turned away as deadline_unmeetable.
            "crowd": tenant("batch", "sk-crowd", limits={"max_queued": 100}),
            "leaver": tenant("batch", "sk-leaver"),
        },
        "admission": {"max_inflight_per_backend": 1, "metrics_poll_ms": 100},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }, t_fixed=0.05)


async def send(stack: Stack, key: str, body: dict, headers: dict | None = None) -> RawClient:
    return await RawClient.send(stack.sidecar, "/v1/completions", body,
                                {**auth(key), **(headers or {})})


def queued(stack: Stack, name: str) -> int:
    return ledger(stack.sidecar, tenant=name).queued


@pytest.fixture
async def holder(stack: Stack) -> AsyncIterator[RawClient]:
    """A long stream that occupies the only admission slot until the test ends; then it
    disconnects (which must abort it at the backend)."""
    await await_for(lambda: running(stack.emulator) == 0, what="an idle backend")
    client = await send(stack, "sk-holder", completion(2000, stream=True))
    assert (await client.read_head()).status == 200
    await client.read_until(b"data: {")
    try:
        yield client
    finally:
        client.close()
        await await_for(lambda: running(stack.emulator) == 0, what="the holder's abort")
        await await_for(lambda: ledger(stack.sidecar).dispatched == 0)


async def test_queue_full_by_requests(stack: Stack, holder: RawClient) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="small")
    waiting = [await send(stack, "sk-small", completion()) for _ in range(2)]
    await await_for(lambda: queued(stack, "small") == 2, what="two queued requests")
    response = await asyncio.to_thread(
        httpx.post, stack.sidecar + "/v1/completions", json=completion(),
        headers=auth("sk-small"), timeout=10)
    error = assert_rejected(response, 429, "queue_full")
    assert error["type"] == "rate_limit_error"
    assert "max_queued" in error["message"]
    for client in waiting:
        client.close()
    await await_for(lambda: queued(stack, "small") == 0, what="the queue to empty")
    delta = await asyncio.to_thread(settled_delta, stack, before, "small")
    assert delta.arrived == 3 and delta.rejected == {"queue_full": 1} and delta.cancelled == 2


async def test_queue_full_by_tokens(stack: Stack, holder: RawClient) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="small-tokens")
    # 4 prompt + 256 estimated output = 260 of the 300 queued tokens allowed.
    first = await send(stack, "sk-small-tokens", completion(256))
    await await_for(lambda: queued(stack, "small-tokens") == 1)
    response = await asyncio.to_thread(
        httpx.post, stack.sidecar + "/v1/completions", json=completion(100),
        headers=auth("sk-small-tokens"), timeout=10)
    error = assert_rejected(response, 429, "queue_full")
    assert "max_queued_tokens" in error["message"]
    # A request that fits what is left is queued.
    second = await send(stack, "sk-small-tokens", completion(30))
    await await_for(lambda: queued(stack, "small-tokens") == 2)
    first.close()
    second.close()
    delta = await asyncio.to_thread(settled_delta, stack, before, "small-tokens")
    assert delta.arrived == 3 and delta.rejected == {"queue_full": 1} and delta.cancelled == 2


def settled_delta(stack: Stack, before, name: str):
    deadline = time.monotonic() + 5
    while True:
        now = ledger(stack.sidecar, tenant=name)
        if now.queued == now.dispatched == 0 or time.monotonic() > deadline:
            return now - before
        time.sleep(0.05)


async def test_deadline_unmeetable_is_decided_at_once(stack: Stack, holder: RawClient) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="hurry")
    # A backlog in hurry's tier; throughput is measured while requests wait upstream.
    backlog = [await send(stack, "sk-backlog", completion(50)) for _ in range(2)]
    await await_for(lambda: queued(stack, "backlog") == 2)
    await await_for(lambda: admin_state(stack.sidecar)["throughput_tokens_per_s"],
                    timeout_s=5, what="a throughput measurement")

    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            stack.sidecar + "/v1/completions", json=completion(),
            headers={**auth("sk-hurry"), "x-weighbridge-deadline-ms": "50"})
        # Decided at arrival, not by waiting: deadline_unmeetable is the ingress check's
        # reason only (core.arrive), and the backlog ahead of it has not moved (the holder
        # keeps the only slot), so nothing was served while it was decided.
        error = assert_rejected(response, 503, "deadline_unmeetable")
        assert await asyncio.to_thread(queued, stack, "backlog") == 2
        assert error["type"] == "server_error"
        assert "predicted wait" in error["message"]
        assert response.headers["retry-after"].isdigit()

        # The same request with a deadline it can meet waits its turn instead.
        patient = await send(stack, "sk-hurry", completion(),
                             {"x-weighbridge-deadline-ms": "60000"})
        await await_for(lambda: queued(stack, "hurry") == 1)
    for client in (*backlog, patient):
        client.close()
    delta = await asyncio.to_thread(settled_delta, stack, before, "hurry")
    assert delta.arrived == 2 and delta.rejected == {"deadline_unmeetable": 1}
    assert delta.cancelled == 1


async def test_disconnect_while_queued_leaves_at_once(stack: Stack, holder: RawClient) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver")
    seen = await asyncio.to_thread(backend_finished, stack.emulator)
    client = await send(stack, "sk-leaver", completion())
    await await_for(lambda: queued(stack, "leaver") == 1)
    client.close()
    # At once: it leaves the queue while the holder still keeps the only slot (its stream
    # lasts ~100 s), so it was not noticed at dispatch. The deadline only bounds the wait.
    await await_for(lambda: queued(stack, "leaver") == 0, timeout_s=30)
    assert await asyncio.to_thread(running, stack.emulator) == 1
    delta = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver") - before
    assert delta.arrived == 1 and delta.cancelled == 1 and delta.dispatched == 0
    state = await asyncio.to_thread(admin_state, stack.sidecar)
    assert "leaver" not in state["scheduler"]["tenants"]  # no queue entry left behind
    assert await asyncio.to_thread(backend_finished, stack.emulator) == seen


async def test_crowd_disconnecting_while_queued(stack: Stack, holder: RawClient) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="crowd")
    seen = await asyncio.to_thread(backend_finished, stack.emulator)
    clients = await asyncio.gather(*(send(stack, "sk-crowd", completion(8))
                                     for _ in range(CROWD)))
    try:
        await await_for(lambda: queued(stack, "crowd") == CROWD, what="the crowd to queue")
    finally:
        for i, client in enumerate(clients):  # half close politely, half reset
            client.close() if i % 2 else client.abort()
    await await_for(lambda: queued(stack, "crowd") == 0, timeout_s=3, what="the crowd to leave")
    delta = await asyncio.to_thread(ledger, stack.sidecar, tenant="crowd") - before
    assert delta.arrived == CROWD and delta.cancelled == CROWD
    assert delta.dispatched == delta.queued == 0
    assert await asyncio.to_thread(backend_finished, stack.emulator) == seen
    scheduler = (await asyncio.to_thread(admin_state, stack.sidecar))["scheduler"]
    assert scheduler["queued"] == 0 and scheduler["queued_tokens"] == 0


async def test_disconnect_mid_stream_aborts_the_backend_request(stack: Stack) -> None:
    await await_for(lambda: running(stack.emulator) == 0)
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver")
    client = await send(stack, "sk-leaver", completion(1000, stream=True))
    head = await client.read_head()
    assert head.status == 200 and head.headers["x-weighbridge-tenant"] == "leaver"
    await client.read_until(b"data: {")
    assert await asyncio.to_thread(running, stack.emulator) == 1
    client.close()
    await await_for(lambda: running(stack.emulator) == 0, timeout_s=3,
                    what="the backend to abort the request")
    await await_for(lambda: ledger(stack.sidecar, tenant="leaver").dispatched == 0)
    delta = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver") - before
    assert delta.arrived == 1 and delta.cancelled == 1 and delta.failed == 0
    metrics = await asyncio.to_thread(scrape, stack.sidecar)
    # What the cut-off stream delivered counts as served.
    assert metrics.total("weighbridge_tokens_served_total", tenant="leaver", kind="output") >= 1
    backend = (await asyncio.to_thread(admin_state, stack.sidecar))["backends"]
    (view,) = backend.values()
    assert view["inflight"] == 0 and view["outstanding_tokens"] == 0 and view["healthy"]


async def test_disconnect_while_a_whole_answer_is_produced(stack: Stack) -> None:
    """A non-streaming request: the client leaves before any byte came back."""
    await await_for(lambda: running(stack.emulator) == 0)
    before = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver")
    client = await send(stack, "sk-leaver", completion(1000))
    await await_for(lambda: running(stack.emulator) == 1, what="the request to run")
    client.abort()
    await await_for(lambda: running(stack.emulator) == 0, timeout_s=3,
                    what="the backend to abort the request")
    await await_for(lambda: ledger(stack.sidecar, tenant="leaver").dispatched == 0)
    delta = await asyncio.to_thread(ledger, stack.sidecar, tenant="leaver") - before
    assert delta.arrived == 1 and delta.cancelled == 1


async def test_queue_drains_in_order_after_the_holder_leaves(stack: Stack) -> None:
    """After all of the above the sidecar still serves: queued requests are dispatched as
    the slot frees, and every request ended exactly once."""
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(*(
            client.post(stack.sidecar + "/v1/completions", json=completion(5),
                        headers=auth("sk-backlog")) for _ in range(4)))
    for response in responses:
        assert_served(response, "backlog")
    queue_ms = sorted(float(r.headers["x-weighbridge-queue-ms"]) for r in responses)
    assert queue_ms[-1] > 0  # with one slot, somebody waited
    final = await asyncio.to_thread(settled, stack.sidecar)
    assert final.failed == 0
    assert await asyncio.to_thread(running, stack.emulator) == 0


async def test_a_first_window_with_nothing_served_leaves_throughput_unknown(processes) -> None:
    """A backend that produces nothing while requests wait (here: it holds every request)
    closes the first throughput window with 0 tokens. That says nothing about capacity: the
    rate stays unknown, so requests with a deadline are queued rather than all turned away
    as unmeetable (and never a 500), and are served once the backend moves."""
    backend = processes.enter_context(StubBackend())
    url = start_sidecar(processes, {
        "tenants": {"t": tenant("standard", "sk-t")},  # standard: a 10 s deadline by default
        "backends": [{"url": backend.url}],
        "admission": {"max_inflight_per_backend": 1},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }).url
    async with httpx.AsyncClient(timeout=30) as client:
        def post() -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post(url + "/v1/completions", json=completion(5),
                                                   headers=auth("sk-t")))

        # One held at the backend, two queued; a second later an arrival closes the first
        # throughput window with nothing served.
        waiting = [post() for _ in range(3)]
        await await_for(lambda: ledger(url).queued == 2)
        await asyncio.sleep(1.1)
        waiting.append(post())
        await await_for(lambda: ledger(url).queued == 3)
        assert (await asyncio.to_thread(admin_state, url))["throughput_tokens_per_s"] is None
        waiting.append(post())
        await await_for(lambda: ledger(url).queued == 4)
        backend.release()
        for response in await asyncio.gather(*waiting):
            assert_served(response, "t")
    delta = await asyncio.to_thread(settled, url)
    assert delta.completed == 5 and not delta.rejected
