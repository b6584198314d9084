"""State shared through a real redis-server (sidecar/shared.py): the shared buckets decide as
the in-process ones do, limits hold across replicas, a replica orders its queue by the
tenants' service on every replica, and an outage falls back to 1/N of the levels last read
(never a full month) and what it spent counts when Redis is back. Replicas here are
scheduling cores in one process, each with its own ``SharedState``: the paths under test are
the Redis scripts and the exchange, not HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.redis import RedisServer
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.sidecar.config import SharedState as SharedStateConfig
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.ratelimit import Admit, calendar_period
from weighbridge.sidecar.rejection import Reject
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.shared import _CALENDAR, SharedState

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
JAN_2026 = 1_767_225_600.0


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    # Persistent, as a deployment that keeps monthly quotas configures it: its levels
    # survive the kills below.
    with RedisServer(persistent=True) as redis_server:
        yield redis_server


def config(url: str, prefix: str, **tenant_limits: Any) -> Config:
    return parse_config({
        "tenants": {
            "a": {"tier": "standard", "api_keys": ["plain:ka"],
                  "limits": {"max_queued": 1000, **tenant_limits}},
            "b": {"tier": "standard", "api_keys": ["plain:kb"],
                  "limits": {"max_queued": 1000}},
        },
        "endpoints": {CHAT: {"cost": "tokens", "quantum": 1000,
                             "initial_output_estimate": 100}},
        "backends": [{"url": "http://127.0.0.1:1", "name": "b1"}],
        "state": {"backend": "redis", "url": url, "key_prefix": prefix,
                  # 2 s, not the default 5 ms: these tests compare decisions, and one answer
                  # slowed by a loaded machine would mark the store down and change them.
                  "timeout_ms": 2_000,
                  "sync_ms": 50, "heartbeat_ms": 200},
    })


_ids = iter(range(10**9))


class Replica(SharedState):
    """A replica's shared state that keeps its core, for the test to drive requests through."""

    def __init__(self, config: SharedStateConfig, core: SchedulingCore) -> None:
        super().__init__(config, core)
        self.core = core


async def send(shared: Replica, tenant: str = "a", prompt: int = 100,
               max_tokens: int | None = 500, now: float = 0.0) -> QueuedRequest | Reject:
    core = shared.core
    estimate = core.estimated_tokens(tenant, CHAT, prompt, max_tokens)
    verdict = await shared.admit(tenant, CHAT, "standard", None, estimate)
    return core.arrive(request_id=f"r{next(_ids)}", tenant=tenant, tier="standard",
                       endpoint=CHAT, prompt_tokens=prompt, max_tokens=max_tokens, now=now,
                       admitted=verdict)


@contextlib.asynccontextmanager
async def two_replicas(server: RedisServer, **limits: Any) -> AsyncIterator[list[Replica]]:
    """Two replicas with tenant a's ``limits``, on their own key prefix (a test's keys never
    meet another's)."""
    prefix = f"t{next(_ids)}"
    states = [Replica(config(server.url, prefix, **limits).state,
                          SchedulingCore(config(server.url, prefix, **limits),
                                         gate_limits=GateLimits(max_inflight=1)))
              for _ in range(2)]
    for state in states:
        await state.start()
    try:
        yield states
    finally:
        for state in states:
            await state.stop()


async def test_a_limit_holds_across_replicas(server: RedisServer) -> None:
    async with two_replicas(server, requests_per_minute=30,
                            tokens_per_minute=1_000_000) as replicas:
        results = [await send(replicas[i % 2]) for i in range(40)]
    admitted = [r for r in results if isinstance(r, QueuedRequest)]
    assert len(admitted) == 30  # not 30 per replica
    rejected = [r for r in results if isinstance(r, Reject)]
    assert all(r.reason == "rate_limited" and r.retry_after_s and r.retry_after_s <= 2.1
               for r in rejected)


async def test_settlements_and_refunds_reach_the_shared_bucket(server: RedisServer) -> None:
    async with two_replicas(server, tokens_per_month=10_000) as (one, two):
        await _settle_and_refund(server, one, two)


async def _settle_and_refund(server: RedisServer, one: Replica, two: Replica) -> None:
    first = await send(one, prompt=100, max_tokens=500)  # charged 100 + 100 estimated
    assert isinstance(first, QueuedRequest)
    (dispatch,) = one.core.dispatch_ready(0.0)
    one.core.on_completed(dispatch.request, 100, 400, 0.0)  # settled to 500
    second = await send(two, prompt=50, max_tokens=500)
    assert isinstance(second, QueuedRequest)
    assert two.core.cancel(second.id, 0.0)  # refunded: its 150 back
    await one._sync()
    await two._sync()
    with server.client() as client:
        keys = client.keys("{" + one.config.key_prefix + "}:bucket:*")
        (key,) = keys
        level = float(client.hget(key, "level") or 0)
    assert level == pytest.approx(10_000 - 500, abs=0.1)


async def test_a_request_that_can_never_fit_says_so(server: RedisServer) -> None:
    async with two_replicas(server, tokens_per_month=1_000) as replicas:
        result = await send(replicas[0], prompt=2_000, max_tokens=10)
    assert isinstance(result, Reject) and result.retry_after_s is None
    assert "never fit" in result.detail


OPS = st.lists(st.tuples(st.sampled_from(["send", "complete", "cancel"]),
                         st.integers(1, 400), st.integers(0, 600)), max_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_shared_buckets_decide_as_the_in_process_ones(server: RedisServer,
                                                      ops: list[tuple[str, int, int]]) -> None:
    """Month and day buckets (refill is negligible over a test): the same sequence of
    requests, completions and cancellations is admitted and rejected alike."""
    limits = {"tokens_per_month": 3_000, "requests_per_day": 12}

    async def run() -> None:
        prefix = f"p{next(_ids)}"
        shared = Replica(config(server.url, prefix, **limits).state,
                             SchedulingCore(config(server.url, prefix, **limits),
                                            gate_limits=GateLimits(max_inflight=100)))
        local = SchedulingCore(config(server.url, prefix, **limits),
                               gate_limits=GateLimits(max_inflight=100))
        await shared.start()
        try:
            live: list[tuple[QueuedRequest, QueuedRequest]] = []
            for kind, prompt, output in ops:
                if kind == "send":
                    remote = await send(shared, prompt=prompt)
                    here = local.arrive(request_id=f"l{next(_ids)}", tenant="a",
                                        tier="standard", endpoint=CHAT, prompt_tokens=prompt,
                                        max_tokens=500, now=0.0)
                    assert type(remote) is type(here)
                    if isinstance(remote, Reject):
                        assert isinstance(here, Reject)
                        assert (remote.retry_after_s is None) == (here.retry_after_s is None)
                    else:
                        assert isinstance(here, QueuedRequest)
                        live.append((remote, here))
                        assert len(list(shared.core.dispatch_ready(0.0))) == 1
                        assert len(list(local.dispatch_ready(0.0))) == 1
                elif live:
                    remote, here = live.pop(0)
                    if kind == "cancel":  # the client went away mid-stream
                        shared.core.on_client_gone(remote, prompt, output // 2, 0.0)
                        local.on_client_gone(here, prompt, output // 2, 0.0)
                    else:
                        shared.core.on_completed(remote, prompt, output, 0.0)
                        local.on_completed(here, prompt, output, 0.0)
                await shared._sync()
            assert shared.errors == 0  # the store never fell back to local limits
        finally:
            await shared.stop()

    asyncio.run(run())


async def test_a_replica_orders_its_queue_by_service_on_every_replica(
        server: RedisServer) -> None:
    """b is served on the other replica while both a and b queue here: here, a goes first
    until b's service elsewhere is matched."""
    async with two_replicas(server) as (here, elsewhere):
        await _fairness(here, elsewhere)


async def _fairness(here: Replica, elsewhere: Replica) -> None:
    for _ in range(6):  # b served 6 x 500 tokens on the other replica
        request = await send(elsewhere, "b", prompt=400)
        assert isinstance(request, QueuedRequest)
        (dispatch,) = elsewhere.core.dispatch_ready(0.0)
        elsewhere.core.on_completed(dispatch.request, 400, 100, 0.0)
    for _ in range(4):
        await send(here, "a", prompt=400)
        await send(here, "b", prompt=400)
    await here._sync()  # b queued here: its total is read (a baseline, nothing charged)
    await elsewhere._sync()  # b's service elsewhere reaches Redis ...
    for _ in range(3):
        request = await send(elsewhere, "b", prompt=400)
        (dispatch,) = elsewhere.core.dispatch_ready(0.0)
        elsewhere.core.on_completed(dispatch.request, 400, 100, 0.0)
    await elsewhere._sync()
    await here._sync()  # ... and 3 x 500 more of it, while b queued here, is charged here
    order = []
    for _ in range(8):
        (dispatch,) = here.core.dispatch_ready(0.0)
        order.append(dispatch.request.tenant)
        here.core.on_completed(dispatch.request, 400, 100, 0.0)
    assert order[:3] == ["a", "a", "a"]


async def test_an_outage_falls_back_to_the_levels_last_read_and_hands_out_nothing_more(
        server: RedisServer) -> None:
    """8 of a month's 20 spent, then Redis killed: the replica that read the level 12 takes
    its share, 12 / 2 = 6, not a fresh 10 of 20; once Redis is back those 6 count, and the
    month ends at exactly 20 across both replicas."""
    async with two_replicas(server, requests_per_month=20) as (one, two):
        await _outage(server, one, two)


async def _outage(server: RedisServer, one: Replica, two: Replica) -> None:
    await one._beat()
    assert one.up and one.replicas == 2
    # Several pooled connections, as a replica under load has.
    warm = await asyncio.gather(*(one.admit("a", CHAT, "standard", None, 1) for _ in range(8)))
    assert all(isinstance(r, Admit) for r in warm)
    server.kill()
    try:
        first = await send(one)  # the failed round trip marks the store down ...
        assert not one.up and isinstance(first, QueuedRequest)  # ... and never fails it
        results = [await send(one) for _ in range(15)]
        assert sum(isinstance(r, QueuedRequest) for r in results) == 6 - 1
        # The other replica never read tenant a's month: in an outage it starts empty.
        assert isinstance(await send(two), Reject) and not two.up
    finally:
        server.start()
    # Delivers the 6 before it admits through Redis again, once, even with a second beat at
    # the same moment (the replica's heartbeat task beside this call, under load: both found
    # the store back and delivered, and the month ended 6 short).
    await asyncio.gather(one._beat(), one._beat())
    await two._beat()
    assert one.up and two.up
    # Month refill over this test (20 per 30 days, well under a request in its seconds).
    after = [await send(replica) for replica in (one, two) * 10]
    assert sum(isinstance(r, QueuedRequest) for r in after) == 20 - 8 - 6
    # No connection from before the outage is left to fail once and mark the store down
    # again: a burst right after finds the store up throughout.
    errors = one.errors
    burst = await asyncio.gather(*(one.admit("b", CHAT, "standard", None, 1) for _ in range(8)))
    assert all(isinstance(r, Admit) for r in burst) and one.up and one.errors == errors


async def test_the_scripts_calendar_is_the_utc_calendar(server: RedisServer) -> None:
    """The Lua calendar the shared buckets reset by, against sidecar.ratelimit's."""
    script = _CALENDAR + """
local i, e = period(tonumber(ARGV[1]), tonumber(ARGV[2]))
return {i, string.format('%.17g', e)}
"""
    walls = [0.0, 951_782_400.0 - 0.5, 951_782_400.0, 4_102_444_799.0]  # 2000-02-29 ...
    walls += [JAN_2026 + day * 86_400 + 0.25 for day in range(0, 800, 7)]
    with server.client() as client:
        for wall in walls:
            for kind, period in ((1, "day"), (2, "month")):
                index, ends = client.eval(script, 0, kind, repr(wall))
                assert (int(index), float(ends)) == calendar_period(wall, period), wall


async def test_a_calendar_month_in_redis_waits_for_the_first(server: RedisServer) -> None:
    async with two_replicas(server, requests_per_month=2, windows="calendar") as (one, _):
        assert isinstance(await one.admit("a", CHAT, "standard", None, 1), Admit)
        assert isinstance(await one.admit("a", CHAT, "standard", None, 1), Admit)
        rejected = await one.admit("a", CHAT, "standard", None, 1)
        assert isinstance(rejected, Reject) and rejected.retry_after_s is not None
        with server.client() as client:
            now = float(client.time()[0])
        # Retry-After is the next first of the month, UTC (a second of slack for the
        # round trips between Redis's clock and this read of it).
        assert rejected.retry_after_s == pytest.approx(
            calendar_period(now, "month")[1] - now, abs=1.0)


async def test_replicas_share_their_outputs_per_model(server: RedisServer) -> None:
    """Decision 0018: every replica's history of recent outputs holds everyone's answers, so
    an answer's expected final length is read from all of a tenant's traffic; the shared
    estimate is keyed by (tenant, endpoint, model), as the estimator is."""
    async with two_replicas(server) as (one, two):
        request = await send(one, max_tokens=None)
        assert isinstance(request, QueuedRequest)
        (dispatch,) = one.core.dispatch_ready(0.0)
        one.core.on_completed(dispatch.request, 100, 700, 0.0)
        await one._sync()  # its output: the shared estimate, and the stream the others read
        await two._sync()
    assert one.core.estimator.expected("a", CHAT) == 700.0
    assert two.core.estimator.final("a", CHAT, 0, None) == 700  # learned from one
    assert two.core.estimator.final("a", CHAT, 0, None, "another-model") is None
    assert two.core.estimator.expected("a", CHAT) == 100.0  # its EMA: its own, or adopted
