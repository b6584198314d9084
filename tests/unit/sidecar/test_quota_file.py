"""The quota file's shell (sidecar.quotas): levels written and read back, one process per
file, an admission whose level is on disk before it is taken, and levels written behind a
settlement. In process, on a temporary file, with a virtual clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.unit.sidecar.test_core import CHAT, arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.quotas import DurableQuotas, QuotaFile
from weighbridge.sidecar.ratelimit import StoredLevel
from weighbridge.sidecar.request import QueuedRequest

WALL = 1_767_225_600.0  # 2026-01-01 UTC


def test_levels_round_trip_and_a_second_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "quotas.sqlite3"
    first = QuotaFile(path)
    assert first.open() == {}
    level = StoredLevel(("endpoint", "a:b", CHAT), "tokens_per_day", 12.5, WALL, 100.0,
                        100 / 86_400, None)
    first.write([level])
    first.write([level])  # an update, not a second row
    with pytest.raises(BlockingIOError):
        QuotaFile(path).open()
    first.close()
    again = QuotaFile(path)
    assert again.open() == {(level.scope, level.name): level}
    again.close()


def core() -> SchedulingCore:
    config = make_config(tenants={"a": {"tier": "standard", "api_keys": ["plain:ka"],
                                        "limits": {"requests_per_month": 3,
                                                   "tokens_per_day": 10_000}},
                                  "b": {"tier": "standard", "api_keys": ["plain:kb"],
                                        "limits": {"requests_per_minute": 100}}})
    return SchedulingCore(config, gate_limits=GateLimits(max_inflight=10))


async def admit(quotas: DurableQuotas, scheduling: SchedulingCore) -> bool:
    estimate = scheduling.estimated_tokens("a", CHAT, 100, 500)
    async with quotas.admission("a", CHAT, "standard", None, estimate):
        return isinstance(arrive(scheduling, "a", prompt_tokens=100), QueuedRequest)


def test_admissions_are_on_disk_before_they_are_taken(tmp_path: Path) -> None:
    path = tmp_path / "quotas.sqlite3"

    async def lifetime(crash: bool) -> tuple[int, DurableQuotas]:
        scheduling = core()
        quotas = DurableQuotas(path, scheduling, lambda: 0.0, 0.0, wall=lambda: WALL)
        await quotas.start()
        admitted = sum([await admit(quotas, scheduling) for _ in range(2)])
        if crash:  # no stop: what is on disk is what the admissions wrote first
            await asyncio.get_running_loop().run_in_executor(quotas._thread,
                                                             quotas.file.close)
            assert quotas._flusher is not None
            quotas._flusher.cancel()
        else:
            await quotas.stop()
        return admitted, quotas

    first, quotas = asyncio.run(lifetime(crash=True))
    assert first == 2 and quotas.writes >= 2 and quotas.up
    second, _ = asyncio.run(lifetime(crash=False))
    assert second == 1  # 3 a month: 2 spent before the crash


def test_a_settlement_is_written_behind_it(tmp_path: Path) -> None:
    path = tmp_path / "quotas.sqlite3"

    async def run() -> float:
        scheduling = core()
        quotas = DurableQuotas(path, scheduling, lambda: 0.0, 0.0, wall=lambda: WALL)
        await quotas.start()
        assert await admit(quotas, scheduling)
        (dispatch,) = scheduling.dispatch_ready(0.0)
        scheduling.on_completed(dispatch.request, 100, 2_000, 0.0)  # far over the estimate
        limiter = scheduling.rate_limiter
        levels = limiter.unsaved(0.0)
        assert [level.name for level in levels] == ["tokens_per_day"]  # a debt to write
        await quotas.stop()  # a clean stop writes it
        reader = QuotaFile(path)
        stored = reader.open()
        reader.close()
        return stored[(("tenant", "a"), "tokens_per_day")].level

    assert asyncio.run(run()) == pytest.approx(10_000 - 2_100)


def test_a_request_without_a_kept_level_never_waits_for_a_write(tmp_path: Path) -> None:
    async def run() -> None:
        scheduling = core()
        quotas = DurableQuotas(tmp_path / "q.sqlite3", scheduling, lambda: 0.0, 0.0,
                               wall=lambda: WALL)
        await quotas.start()
        async with quotas._lock:  # a write in progress
            async with asyncio.timeout(5):  # a bound on a hang, not a measurement
                async with quotas.admission("b", CHAT, "standard", None, 600):
                    assert isinstance(arrive(scheduling, "b"), QueuedRequest)
        await quotas.stop()

    asyncio.run(run())
