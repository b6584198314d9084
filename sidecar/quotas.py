"""The day and month limits' levels kept in a local SQLite file, for a sidecar that runs alone
(``state: local``): a restart or a crash hands no quota out twice (docs/sidecar.md, "Rate
limits"; the arithmetic is ``sidecar.ratelimit``'s, "Durable levels").

:class:`QuotaFile` is the file: one table of levels, WAL journal, ``synchronous=FULL`` (a
commit is on disk when it returns, so a power cut loses nothing committed either), every
write one transaction, used from one thread only. An exclusive ``flock`` on the file keeps a
second sidecar from keeping the same levels. :class:`DurableQuotas` is the shell around it:

* at start it reads every stored level and gives the core a limiter that starts each long
  window from its level (``BucketSettings.restored``), refilled by the wall-clock time since;
* before a request of a tenant with such a limit is admitted, :meth:`admission` writes the
  levels the limiter asks for (``reservations``), off the event loop, and admits within the
  same lock, so no admission is handed out before its level is on disk;
* every ``FLUSH_S`` it writes the levels settlements and refunds moved (``unsaved``), and at
  a clean stop every level as it is.

A write that fails (a full disk, a file removed) marks the file down: one log line, the
``weighbridge_quota_store_up`` gauge at 0, and the limits hold in memory as before (a crash
meanwhile would hand out again what was spent since); the flusher writes every level again
and marks it up at its first success.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from weighbridge.sidecar.ratelimit import (
    LONG_WINDOWS,
    BucketSettings,
    ScopeKey,
    StoredLevel,
    TenantRateLimiter,
)
from weighbridge.sidecar.replica import ReplicatedCore

__all__ = ["FLUSH_S", "DurableQuotas", "QuotaFile", "QuotaFileCollector"]

log = logging.getLogger("weighbridge.sidecar")

# How often settlements' and refunds' levels are written behind them: what a crash can lose
# of a debt an under-estimated request ran into (its admission itself is written before).
FLUSH_S = 0.2
_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS levels (
  scope TEXT NOT NULL,      -- the scope key, a JSON array: ["tenant", "acme"]
  name TEXT NOT NULL,       -- the limit: "tokens_per_month"
  level REAL NOT NULL,      -- at wall-clock time `at`
  at REAL NOT NULL,         -- seconds since the epoch (UTC)
  capacity REAL NOT NULL,   -- the limit the level is of
  rate REAL NOT NULL,       -- refill per second (a calendar window's is not used)
  period INTEGER,           -- a calendar window's period index; NULL: rolling
  PRIMARY KEY (scope, name)
) WITHOUT ROWID
"""


class QuotaFile:
    """The SQLite file of levels; every method blocks (call from one worker thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None

    def open(self) -> dict[tuple[ScopeKey, str], StoredLevel]:
        """Open (creating it) and read every level; raises ``OSError`` or
        ``sqlite3.Error`` when it cannot, ``BlockingIOError`` when another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._lock_fd = fd
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db = db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(_SCHEMA)
        out: dict[tuple[ScopeKey, str], StoredLevel] = {}
        for scope, name, level, at, capacity, rate, period in db.execute(
                "SELECT scope, name, level, at, capacity, rate, period FROM levels"):
            try:
                key = tuple(str(part) for part in orjson.loads(scope))
            except orjson.JSONDecodeError:
                continue  # not a row of ours
            if name in LONG_WINDOWS:
                out[(key, name)] = StoredLevel(key, name, float(level), float(at),
                                               float(capacity), float(rate),
                                               None if period is None else int(period))
        return out

    def write(self, levels: Sequence[StoredLevel]) -> None:
        """Every level in one transaction, on disk when this returns."""
        assert self._db is not None
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT INTO levels (scope, name, level, at, capacity, rate, period) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (scope, name) DO UPDATE SET "
                "level = excluded.level, at = excluded.at, capacity = excluded.capacity, "
                "rate = excluded.rate, period = excluded.period",
                [(orjson.dumps(list(s.scope)).decode(), s.name, s.level, s.at_s, s.capacity,
                  s.rate, s.period) for s in levels])
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


class DurableQuotas:
    def __init__(self, path: Path, core: ReplicatedCore, clock: Callable[[], float],
                 reserve_ahead: float, wall: Callable[[], float] = time.time) -> None:
        """``clock``: the core's (monotonic) clock; ``wall``: seconds since the epoch, read
        once at start to place ``clock`` on the UTC calendar."""
        self.file = QuotaFile(path)
        self._core = core
        self._clock = clock
        self._wall = wall
        self._reserve_ahead = reserve_ahead
        self._lock = asyncio.Lock()  # reservations, writes and admissions take turns
        # One thread, so the connection is only ever used from it.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="quota-file")
        self._flusher: asyncio.Task[None] | None = None
        self.up = False
        self.opened = False
        self.writes = 0
        self.errors = 0
        self.restored = 0
        self._limiter: TenantRateLimiter | None = None

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def start(self) -> None:
        """Read the file and give the core its limiter; a file that cannot be opened leaves
        the limits in memory, said in one log line."""
        try:
            stored = await self._run(self.file.open)
        except (OSError, sqlite3.Error) as e:
            self.errors += 1
            # An error where a limit is lost by it, a note where none is configured yet.
            level = logging.ERROR if self._core.limit_table.keeps_long_windows() else \
                logging.INFO
            log.log(level, "quota file %s cannot be used (%s): the day and month limits are "
                    "kept in memory only, and a restart refills them", self.file.path,
                    type(e).__name__ + (f": {e}" if str(e) else ""))
            return
        self.opened = self.up = True
        self.restored = len(stored)
        offset = self._wall() - self._clock()
        core = self._core
        self._limiter = core.rate_limiter = TenantRateLimiter(
            core.limit_table, settings=BucketSettings(
                wall_offset_s=offset, durable=True, restored=stored),
            reserve_ahead=self._reserve_ahead)
        log.info("quota file %s: %d levels restored", self.file.path, len(stored))
        self._flusher = asyncio.create_task(self._flushes(), name="quota-file:flush")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self.opened:
            async with self._lock:
                limiter = self._active()
                if limiter is not None:
                    await self._write(limiter, limiter.unsaved(self._clock(), exact=True))
            await self._run(self.file.close)
        self._thread.shutdown(wait=True)

    def _active(self) -> TenantRateLimiter | None:
        """The core's limiter, if it is still the one this shell keeps."""
        limiter = self._limiter
        return limiter if limiter is not None and self._core.rate_limiter is limiter else None

    async def _write(self, limiter: TenantRateLimiter, levels: list[StoredLevel]) -> None:
        """Write, then tell the limiter; a failure marks the file down and the levels held
        in memory (the limits still hold in this process)."""
        if not levels:
            return
        try:
            await self._run(self.file.write, levels)
        except (OSError, sqlite3.Error) as e:
            self.errors += 1
            if self.up:
                self.up = False
                log.error("quota file %s: a write failed (%s): the day and month limits "
                          "hold in memory; a crash now would refill what was spent since",
                          self.file.path, type(e).__name__ + (f": {e}" if str(e) else ""))
        else:
            self.writes += 1
        limiter.stored(levels, self._clock())

    @contextlib.asynccontextmanager
    async def admission(self, tenant: str, endpoint: str, tier: str, model: str | None,
                        tokens: int) -> AsyncIterator[None]:
        """Admit inside this: the levels the request needs are on disk before, and no other
        admission moves them in between."""
        limiter = self._active()
        model = self._core.request_model(model)
        if limiter is None or not limiter.keeps_levels(tenant, endpoint, tier, model):
            yield  # no level of its is kept: it need not wait for another's write
            return
        async with self._lock:
            levels = limiter.reservations(tenant, endpoint, tokens, self._clock(), tier,
                                          model)
            await self._write(limiter, levels)
            yield

    async def _flushes(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            limiter = self._active()
            if limiter is None:
                continue
            async with self._lock:
                if self.up:
                    await self._write(limiter, limiter.unsaved(self._clock()))
                    continue
                # Down: every level again, so what was held in memory meanwhile is written.
                levels = limiter.unsaved(self._clock(), exact=True)
                try:
                    await self._run(self.file.write, levels)
                except (OSError, sqlite3.Error):
                    self.errors += 1
                    continue
                self.writes += 1
                limiter.stored(levels, self._clock())
                self.up = True
                log.warning("quota file %s: writes succeed again", self.file.path)

    def snapshot(self) -> dict[str, object]:
        return {"file": str(self.file.path), "up": self.up, "restored": self.restored,
                "writes": self.writes, "errors": self.errors}


class QuotaFileCollector:
    """The quota file's health on /metrics (absent without one)."""

    def __init__(self, quotas: DurableQuotas | None) -> None:
        self.quotas = quotas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        quotas = self.quotas
        if quotas is None:
            return
        up = GaugeMetricFamily("weighbridge_quota_store_up",
                               "1 while the day and month limits' levels are written to the "
                               "quota file; 0: they are kept in memory only.")
        up.add_metric([], 1 if quotas.up else 0)
        writes = CounterMetricFamily("weighbridge_quota_store_writes",
                                     "Transactions written to the quota file.")
        writes.add_metric([], quotas.writes)
        errors = CounterMetricFamily("weighbridge_quota_store_errors",
                                     "Quota file opens and writes that failed.")
        errors.add_metric([], quotas.errors)
        yield from (up, writes, errors)
