"""The health prober's thresholds, in process: a scripted backend whose /health answers a
sequence of statuses, in front of the real ``Sidecar`` app (aiohttp's test server).

A healthy backend is marked unhealthy only after ``unhealthy_threshold`` failed probes in a
row (one late answer is weak evidence: the probe's timer runs on the sidecar's own loop, which
a burst of arrivals can hold for a second); one 200 brings it back. Probes are sequential, so
the backend receiving probe *n + 1* means the sidecar has acted on probe *n*: the test waits on
that, never on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config


@dataclass
class ScriptedHealth:
    """/health answers ``statuses`` in order, then 200 forever; every probe is counted."""

    statuses: list[int]
    probes: int = 0
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def health(self, _request: web.Request) -> web.Response:
        status = self.statuses[self.probes] if self.probes < len(self.statuses) else 200
        async with self.arrived:
            self.probes += 1
            self.arrived.notify_all()
        return web.Response(status=status)

    async def wait_for_probe(self, n: int) -> None:
        async with asyncio.timeout(10), self.arrived:
            await self.arrived.wait_for(lambda: self.probes >= n)


@dataclass
class Setup:
    backend: ScriptedHealth
    sidecar: Sidecar

    def healthy(self) -> bool:
        assert self.sidecar.pool is not None
        return self.sidecar.pool.states["b"].healthy

    async def after_probe(self, n: int) -> bool:
        """Whether the backend is healthy once the sidecar has acted on probe ``n``."""
        await self.backend.wait_for_probe(n + 1)
        return self.healthy()


async def started(statuses: list[int], threshold: int | None,
                  interval_ms: int = 5) -> AsyncIterator[Setup]:
    """The first status answers the start-up probe (probe 1)."""
    backend = ScriptedHealth(statuses)
    app = web.Application()
    app.router.add_get("/health", backend.health)
    probe: dict[str, int] = {"interval_ms": interval_ms}
    if threshold is not None:
        probe["unhealthy_threshold"] = threshold
    async with TestServer(app) as server:
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": ["plain:sk-probe"]}},
            "backends": [{"name": "b", "url": str(server.make_url("")).rstrip("/")}],
            "health_probe": probe,
        })
        sidecar = Sidecar(config)
        async with TestServer(sidecar.app):
            yield Setup(backend, sidecar)


@pytest.fixture
async def default_threshold(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    async for setup in started(request.param, None):
        yield setup


@pytest.mark.parametrize("default_threshold", [[200, 500, 500, 200, 500, 500, 200]],
                         indirect=True)
async def test_two_failed_probes_in_a_row_do_not_mark_a_backend(
        default_threshold: Setup) -> None:
    setup = default_threshold
    for n in range(1, 8):
        assert await setup.after_probe(n), f"marked unhealthy after probe {n}"


@pytest.mark.parametrize("default_threshold", [[200, 500, 500, 503, 500, 200, 200]],
                         indirect=True)
async def test_the_third_failed_probe_marks_it_and_one_200_brings_it_back(
        default_threshold: Setup) -> None:
    setup = default_threshold
    assert [await setup.after_probe(n) for n in range(1, 8)] == [
        True, True, True, False, False, True, True]


async def test_a_threshold_of_one_marks_it_at_the_first_failure() -> None:
    async for setup in started([200, 200, 500, 200], threshold=1):
        assert [await setup.after_probe(n) for n in range(1, 5)] == [True, True, False, True]


async def test_a_backend_down_at_start_up_is_unhealthy_before_serving() -> None:
    """The start-up probe has no threshold: nothing was ever heard from the backend."""
    async for setup in started([500], threshold=None, interval_ms=60_000):
        assert setup.backend.probes == 1
        assert not setup.healthy()
