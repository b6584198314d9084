"""Helpers for the acceptance scenarios (tests/integration/sidecar/test_scenarios.py): config
builders, a background sampler of the sidecar's and the emulators' /metrics, and
waiting for everything to drain between the phases of a comparison.

Everything runs against real processes on loopback (``weighbridge.launch``); the load comes
from ``tests/support/driver.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from tests.support.metrics import Scrape
from tests.support.metrics import scrape_async as scrape
from weighbridge.launch import ServerProcess

MODEL = "weighbridge-emulator"  # the emulator's default --model-name


def key(name: str) -> str:
    """The (test-only, plain) API key of tenant ``name``."""
    return f"sk-{name}"


def tenant(name: str, tier: str, weight: float = 1.0, **extra: object) -> dict[str, object]:
    """A tenant entry for a sidecar config mapping (plain keys: tests only), with queues
    deep enough for a backlogged scenario."""
    # Why the ignore below: a caller's limits is a mapping; the sidecar's config validation checks
    # it.
    limits = {"max_queued": 5000, **extra.pop("limits", {})}  # type: ignore[dict-item]
    return {"tier": tier, "weight": weight, "api_keys": [f"plain:{key(name)}"],
            "limits": limits, **extra}


@contextlib.asynccontextmanager
async def started(*procs: ServerProcess) -> AsyncIterator[tuple[ServerProcess, ...]]:
    """Start ``procs`` in parallel (each waits until healthy) and stop them all at the end of
    the block, whatever happens."""
    try:
        results = await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield procs
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs))


# ----------------------------------------------------------------------------- /metrics


@dataclass
class Sampler:
    """Scrapes ``urls`` every ``interval_s`` in the background (``async with``); keeps every
    scrape as ``samples[url] = [Scrape, ...]``. Bounded: it stops when the block ends."""

    session: aiohttp.ClientSession
    urls: Sequence[str]
    interval_s: float = 0.05
    samples: dict[str, list[Scrape]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            scrapes = await asyncio.gather(*(scrape(self.session, u) for u in self.urls),
                                           return_exceptions=True)
            for url, result in zip(self.urls, scrapes, strict=True):
                if isinstance(result, Scrape):
                    self.samples.setdefault(url, []).append(result)
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.create_task(self._run(), name="metrics-sampler")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def drained(session: aiohttp.ClientSession, sidecar_url: str,
                  emulator_urls: Sequence[str], timeout_s: float = 15.0) -> None:
    """Wait (bounded) until the sidecar holds nothing and the emulators run nothing: the
    next phase of a comparison then starts from idle engines."""
    deadline = time.monotonic() + timeout_s
    while True:
        side = await scrape(session, sidecar_url)
        busy = side.total("weighbridge_requests_queued") + side.total(
            "weighbridge_requests_dispatched")
        for url in emulator_urls:
            emu = await scrape(session, url)
            busy += emu.total("vllm:num_requests_running") + emu.total(
                "vllm:num_requests_waiting")
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained after {timeout_s} s ({busy:.0f} requests left)")
        await asyncio.sleep(0.1)


def engine_tokens(scrape_: Scrape) -> float:
    """Prompt + generation tokens an emulator (or vLLM) has processed."""
    return scrape_.total("vllm:prompt_tokens_total") + scrape_.total(
        "vllm:generation_tokens_total")


def fmt_shares(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in values.items())
