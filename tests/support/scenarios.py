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
from typing import Any

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


# ======================================================= the scenarios, defined once
#
# The fairness and tiers scenarios run twice: live (tests/integration/sidecar/
# test_scenarios.py, real processes on loopback) and in virtual time (tests/unit/simulation/
# test_scenarios_in_virtual_time.py, the same sidecar core against the same engine model,
# deterministic). Both take their engines, tenants and sidecar settings from here.

# Fairness. Three tenants in one tier, weights 1:1:2: "short" sends 64 + 32-token requests,
# "long" 1024 + 256, "mixed" (weight 2) alternates the two. Each has 48 closed-loop clients,
# more than the engine's 32 slots, so every tenant is backlogged at the sidecar throughout.
# Engine: 32 sequences, B = 2048, 1,600 KV blocks of 16 = 25,600 tokens, about 32 sequences
# of the in-flight mix's average length (some preemption happens). The endpoint quantum is
# 512 tokens, about one request per turn, as the design sizes it for streaming endpoints.
FAIR_ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "num_kv_blocks": 1600,
               "block_size": 16, "max_model_len": 2048}
SHORT = (64, 32)
LONG = (1024, 256)
FAIR_WEIGHTS = {"short": 1.0, "long": 1.0, "mixed": 2.0}
FAIR_CLIENTS = 48
FAIR_QUANTUM = 512
FAIR_WARMUP_S, FAIR_END_S = 3.0, 17.0


def fair_config(policy: str) -> dict[str, Any]:
    """The fairness scenario's sidecar settings (all but the backends) under ``policy``."""
    return {"tenants": {n: tenant(n, "standard", w) for n, w in FAIR_WEIGHTS.items()},
            "scheduler": {"policy": policy},
            "endpoints": {"/v1/completions": {"cost": "tokens", "quantum": FAIR_QUANTUM}},
            "admission": {"max_running_per_backend": 32, "max_inflight_per_backend": 32},
            # No SLO: deep backlogs are the premise here, not early rejections.
            "tiers": {"standard": {"rank": 1}}}


def drr_share_tolerance(name: str, per_weight_tokens: float,
                        forfeited: Mapping[str, float]) -> float:
    """How far tenant ``name``'s weight-normalised service, relative to the mean, may be off
    over a window in which every tenant was backlogged, by DRR's own guarantee
    (sidecar/drr.py, "The guarantee"): two backlogged flows' weight-normalised booked
    service differ by less than ``2Q + C_i/w_i + C_j/w_j`` tokens (Q the quantum, C a flow's
    largest request) plus the quanta each forfeited when admission passed it over
    (``forfeited``: the window's increase of weighbridge_drr_quanta_forfeited_total, which
    DRR does not give back), taken against the worst other flow, over ``per_weight_tokens``
    (the window's service per unit of weight)."""
    largest = {"short": sum(SHORT), "long": sum(LONG), "mixed": sum(LONG)}

    def own(n: str) -> float:
        return (largest[n] + FAIR_QUANTUM * forfeited.get(n, 0.0)) / FAIR_WEIGHTS[n]

    other = max(own(n) for n in FAIR_WEIGHTS if n != name)
    return (2 * FAIR_QUANTUM + own(name) + other) / per_weight_tokens


# Tiers. "bulk" (batch tier) floods with 64 closed-loop clients of 1024 + 256 tokens; "app",
# an interactive tenant, runs its own batch jobs (8 clients of 512 + 128) down a tier with
# x-weighbridge-tier: batch; "chat" (interactive) sends 128 + 32-token requests as a Poisson
# stream of 15/s once the flood has filled the engine. Engine: 32 sequences, B = 2048,
# 2,304 KV blocks (36,864 tokens, 32 of the flood's average sequence), priority scheduling
# and vLLM's --long-prefill-token-threshold 512. Sidecar: 4 headroom slots, per-tenant
# prefill pacing at 2,048 tokens and priorities passed to the engine.
TIER_ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "num_kv_blocks": 2304,
               "block_size": 16, "max_model_len": 2048, "scheduling_policy": "priority",
               "long_prefill_token_threshold": 512}
TIER_FLOOD, TIER_JOBS, TIER_CHAT = (1024, 256), (512, 128), (128, 32)
TIER_FLOOD_CLIENTS, TIER_JOB_CLIENTS = 64, 8
TIER_CHAT_RATE = 15.0
TIER_CHAT_START_S = 2.0
TIER_SLO_S = 0.5  # the interactive tier's TTFT target


def tier_config(policy: str) -> dict[str, Any]:
    """The tiers scenario's sidecar settings (all but the backends) under ``policy``."""
    return {"tenants": {"chat": tenant("chat", "interactive"),
                        "app": tenant("app", "interactive"),
                        "bulk": tenant("bulk", "batch")},
            "scheduler": {"policy": policy},
            "admission": {"max_running_per_backend": 32, "max_inflight_per_backend": 32,
                          "headroom_slots": 4, "max_prefill_tokens_inflight": 2048}}
