"""State several sidecar replicas share through Redis (docs/sidecar.md, "Several replicas").

Replicas never talk to each other: each sees the others only through Redis, and still gates
its own dispatches on the backends' /metrics (where the others' work shows as load).
:class:`SharedState` belongs to the application, which starts it on startup and stops it on
shutdown; it reaches the scheduling core only through ``sidecar.replica.Replica``, what this
process gives the others and takes from them.

What is shared, and how
-----------------------
* **Rate-limit buckets.** The buckets of ``weighbridge.sidecar.ratelimit`` (its ``LimitTable``
  says which apply to a request), one Redis hash each, by the same scope keys, refilled by
  Redis's own clock so that replicas' clocks never meet. Check-and-take is one server-side
  script, one round trip per request on the admission path (:meth:`admit`); settlements and
  refunds are batched into the sync below, never one per streamed chunk. A bucket's key expires
  when it would have refilled to full, which is what a missing key means, so idle tenants cost
  no memory and day and month buckets outlive every replica.
* **Service.** Every ``sync_ms`` each replica adds the DRR turns it charged per (pool, tier,
  tenant) to one hash and reads the totals of the tenants queued with it. What a total grew
  by beyond this replica's own part is other replicas' service, charged to the tenant's
  credit here (``Replica.charge_foreign``): each replica orders its queue by the tenant's
  service across all of them.
* **Output estimates.** Observations are folded, in arrival order, into one EMA per
  (tenant, endpoint) by a script, and each replica adopts the result.
* **Where prompts went.** Every sync each replica appends the blocks of the prompts it sent
  since the last (backend, block size, chained block hashes: ``sidecar.prefix``, the same
  in every process) to one stream, and reads the entries the others appended since its last
  read: each replica's prefix index learns the others' dispatches as its own, so a
  conversation's next turn goes to the engine holding its history whichever replica takes
  it (``prefix_aware``). An entry also carries the (tenant, session, backend) of every
  request that named a session (field ``s``): each replica's ``session_affinity`` binds
  the others' programs as its own, so a program's calls stay on one backend whichever
  replica takes them. The stream keeps the last ``PREFIX_STREAM_LEN`` entries; a replica
  starting reads those. An entry also says how many prompt tokens its replica sent each
  backend (field ``t``, every prompt's, prefix or not): each replica compares the fleet's
  prompts, not only its own, with an engine's prefix-cache lookups (``sidecar.prefix``'s
  ``CacheShare``), so its replicas do not read as clients it cannot see.
* **Replicas.** Each registers in a sorted set every ``heartbeat_ms``, scored by Redis's clock;
  N counts those heard from within 3 beats.

Faults
------
An error, or an answer slower than ``timeout_ms``, marks the store down: one log line, the
``weighbridge_shared_state_up`` gauge at 0, and the core falls back to its own buckets, each
1/N of its limit, starting at 1/N of the level Redis last answered for it (every admission
and settlement answers the levels of its buckets); a day or month bucket this replica never
read starts empty, never full (a minute one full: a minute's worth at most). No request
fails for it. The heartbeat keeps trying; the first answer marks the store up again (one log
line) and admissions are shared again. What this replica's own buckets took meanwhile (the
outage's admissions, their settlements) is owed to the shared buckets and goes with the
next sync, as do the settlements of requests admitted by Redis before (up to
``MAX_PENDING_CHARGES``): the outage's spending counts against the month. Redis keeps the
levels as durably as it is configured to (docs/sidecar.md, "Rate limits": ``appendonly``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from weighbridge.redaction import redact_url
from weighbridge.sidecar.config import SharedState as SharedStateConfig
from weighbridge.sidecar.estimator import Observation
from weighbridge.sidecar.ratelimit import (
    Admit,
    BucketSpec,
    ScopeKey,
    StoredLevel,
    calendar_period,
)
from weighbridge.sidecar.rejection import RATE_LIMITED, Reject
from weighbridge.sidecar.replica import SERVICE_SYNC_S, Replica, ReplicatedCore
from weighbridge.sidecar.request import QueuedRequest

__all__ = ["MAX_PENDING_CHARGES", "PREFIX_STREAM_LEN", "SharedState", "SharedStateCollector",
           "bucket_key", "period_kind"]

log = logging.getLogger("weighbridge.sidecar")

# Settlements kept for Redis while it is down; beyond, the oldest are dropped (counted).
MAX_PENDING_CHARGES = 100_000
HEARTBEATS_TO_EXPIRE = 3
# Entries of the stream of prompts sent (one per replica per sync that sent any) Redis keeps:
# at 30 ms a sync, a minute of three busy replicas; an index is a prediction, so what a
# replica long behind misses only costs it cache hits.
PREFIX_STREAM_LEN = 6000
PREFIX_READ_COUNT = 500  # entries read per sync at most (a replica catching up reads on)

# The UTC calendar in Lua (Howard Hinnant's days/civil algorithms), as
# sidecar.ratelimit.calendar_period: `period(kind, now)` is the index of the day (kind 1) or
# month (kind 2) holding `now` and when the next one starts.
_CALENDAR = """
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end
local function period(kind, at)
  local day = math.floor(at / 86400)
  if kind == 1 then return day, (day + 1) * 86400 end
  local y, m = civil_from_days(day)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return (y - 1970) * 12 + m - 1, days_from_civil(ny, nm, 1) * 86400
end
"""

# The bucket arithmetic of sidecar.ratelimit.TokenBucket, in Lua, on Redis's clock: `level`
# reads a bucket refilled to `now` (a missing key is a full bucket), `store` writes it back
# with an expiry at the moment it would be full again (what a missing key means). A bucket
# keeps the size it was stored with: a replica that meets it at another size (a reloaded
# limit) refills it at the stored rate to the stored capacity, then keeps what was spent
# (sidecar.ratelimit, "Reload"), once, inside the script, so no replica counts it twice.
# `kind` 1 and 2 are calendar windows (a UTC day, a UTC month): full again, less a debt, in
# a period after the one stored (`p`), no refill in between; 0 is a rolling bucket.
_BUCKET = _CALENDAR + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, cap, rate, kind)
  local v = redis.call('HMGET', key, 'level', 'at', 'cap', 'rate', 'p')
  if not v[1] then return cap end
  local l, at = tonumber(v[1]), tonumber(v[2])
  local was_cap, was_rate, p = tonumber(v[3]) or cap, tonumber(v[4]) or rate, tonumber(v[5])
  if p and kind > 0 then
    if period(kind, now) ~= p then l = was_cap + math.min(0, l) end
  elseif now > at then l = math.min(was_cap, l + (now - at) * was_rate) end
  return l + (cap - was_cap)
end
local function store(key, cap, rate, kind, l)
  redis.call('HSET', key, 'level', string.format('%.17g', l), 'at', string.format('%.17g', now),
             'cap', string.format('%.17g', cap), 'rate', string.format('%.17g', rate))
  if kind > 0 then
    local p, ends = period(kind, now)
    redis.call('HSET', key, 'p', p)
    -- A debt carries into the next period: kept until that one ends too.
    if l < 0 then ends = ends + 32 * 86400 end
    redis.call('PEXPIREAT', key, math.ceil(ends * 1000) + 1000)
  else
    redis.call('HDEL', key, 'p')
    redis.call('PEXPIRE', key, math.ceil((cap - l) / rate * 1000) + 1000)
  end
end
local function wait_for(kind, rate, missing)
  if kind > 0 then
    local _, ends = period(kind, now)
    return math.max(ends - now, 1e-9)
  end
  return missing / rate
end
"""

# KEYS: the buckets; ARGV: capacity, rate per s, kind, amount for each. Returns {status,
# index, wait_s, now, levels...}: status 1 (taken; the levels after), 0 (the bucket at
# index is short for wait_s; nothing taken; the levels read) or -1 (the amount exceeds the
# bucket at index's capacity: it can never fit).
_ADMIT = _BUCKET + """
local levels = {}
local wait, binding = 0, 0
for i = 1, #KEYS do
  local cap, rate = tonumber(ARGV[4*i-3]), tonumber(ARGV[4*i-2])
  local kind, amount = tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
  if amount > cap * (1 + 1e-9) then return {-1, i, '0', tostring(now)} end
  levels[i] = level(KEYS[i], cap, rate, kind)
  local missing = amount - levels[i]
  if missing > 1e-9 * math.max(1, amount) then
    local w = wait_for(kind, rate, missing)
    if w > wait then wait, binding = w, i end
  end
end
local out = {0, binding, tostring(wait), string.format('%.17g', now)}
if wait == 0 then
  out[1] = 1
  for i = 1, #KEYS do
    local cap, rate = tonumber(ARGV[4*i-3]), tonumber(ARGV[4*i-2])
    local kind, amount = tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
    levels[i] = levels[i] - amount
    store(KEYS[i], cap, rate, kind, levels[i])
  end
end
for i = 1, #KEYS do out[#out + 1] = string.format('%.17g', levels[i]) end
return out
"""

# KEYS: buckets; ARGV: capacity, rate, kind and delta for each (positive: a further charge,
# which may go into debt; negative: a refund, never above capacity). Returns {now,
# levels...}.
_ADJUST = _BUCKET + """
local out = {string.format('%.17g', now)}
for i = 1, #KEYS do
  local cap, rate = tonumber(ARGV[4*i-3]), tonumber(ARGV[4*i-2])
  local kind, delta = tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
  local l = level(KEYS[i], cap, rate, kind)
  if delta > 0 then l = l - delta else l = math.min(cap, l - delta) end
  store(KEYS[i], cap, rate, kind, l)
  out[#out + 1] = string.format('%.17g', l)
end
return out
"""

# KEYS[1]: the estimates hash; ARGV[1]: alpha, then (field, tokens) pairs in arrival order.
# Returns (field, ema) pairs, one per observation.
_ESTIMATES = """
local alpha = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 2 do
  local prev = redis.call('HGET', KEYS[1], ARGV[i])
  local x = tonumber(ARGV[i + 1])
  local v = x
  if prev then v = tonumber(prev) + alpha * (x - tonumber(prev)) end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', v))
  out[#out + 1] = ARGV[i]
  out[#out + 1] = string.format('%.17g', v)
end
return out
"""

# KEYS[1]: the replicas' sorted set, KEYS[2]: this replica's load hash; ARGV[1]: this
# replica's id, ARGV[2]: the load's expiry in ms, ARGV[3]: the prefix of every replica's load
# hash, then (field, "in flight,backlogged") pairs. Stores this replica's load and returns
# the others', summed: (field, in flight, replicas where backlogged) triples.
_LOAD = """
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
if #ARGV >= 4 then redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2])) end
local totals, order = {}, {}
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if member ~= ARGV[1] then
    local flat = redis.call('HGETALL', ARGV[3] .. member)
    for j = 1, #flat, 2 do
      local comma = string.find(flat[j + 1], ',', 1, true)
      local inflight = tonumber(string.sub(flat[j + 1], 1, comma - 1))
      local backlogged = tonumber(string.sub(flat[j + 1], comma + 1))
      local t = totals[flat[j]]
      if not t then
        t = {0, 0}
        totals[flat[j]] = t
        order[#order + 1] = flat[j]
      end
      t[1], t[2] = t[1] + inflight, t[2] + backlogged
    end
  end
end
local out = {}
for _, f in ipairs(order) do
  out[#out + 1] = f
  out[#out + 1] = totals[f][1]
  out[#out + 1] = totals[f][2]
end
return out
"""

# KEYS[1]: the replicas' sorted set; ARGV: this replica's id, expiry in s. Returns N.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
"""


def period_kind(spec: BucketSpec) -> int:
    """The scripts' `kind` of a bucket: 0 rolling, 1 a UTC day, 2 a UTC month."""
    return {None: 0, "day": 1, "month": 2}[spec.period]


def _bucket_args(spec: BucketSpec, amount: float) -> list[float]:
    return [spec.capacity, spec.rate, period_kind(spec), amount]


def _part(text: str) -> str:
    """One part of a key, with the separator escaped (tenant names may hold ':')."""
    return text.replace("%", "%25").replace(":", "%3A")


def bucket_key(prefix: str, scope: ScopeKey, name: str) -> str:
    # The hash tag puts every key of one deployment in one Redis Cluster slot: the scripts
    # touch several at once.
    return ":".join(["{" + prefix + "}", "bucket", *map(_part, scope), name])


def _field(*parts: str) -> str:
    return ":".join(map(_part, parts))


def _unfield(text: str) -> list[str]:
    return [p.replace("%3A", ":").replace("%25", "%") for p in text.split(":")]


@dataclass(slots=True)
class _Pending:
    request: QueuedRequest
    delta: int


@dataclass(slots=True)
class _Outgoing:
    """What one sync tells the others, taken from the replica."""

    booked: dict[tuple[str, str, str], float]  # service per (pool, tier, tenant)
    observations: list[Observation]  # (tenant, endpoint, model, output tokens)
    sent: list[tuple[str, int, tuple[int, ...]]]  # prompts sent: (backend, block size, blocks)
    sent_tokens: dict[str, int]  # prompt tokens sent per backend
    sessions: list[tuple[str, str, str]]  # (tenant, session, backend) of requests sent


class SharedState:
    def __init__(self, config: SharedStateConfig, core: ReplicatedCore,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_change(up)``: called once per transition (the metric follows ``up``)."""
        if config.url is None:
            raise ValueError("a Redis URL is required")
        self.config = config
        self._shown_url = redact_url(config.url)  # for the log: never the password
        self.replica = Replica(core)
        self.on_change = on_change
        self.clock = clock
        self.replica_id = uuid.uuid4().hex[:12]
        self.up = False
        self.replicas = 1  # last known N (itself included)
        self.dropped_charges = 0
        self.errors = 0
        prefix = config.key_prefix
        self._prefix = prefix
        self._served_key = "{" + prefix + "}:served"
        self._estimates_key = "{" + prefix + "}:estimates"
        self._replicas_key = "{" + prefix + "}:replicas"
        self._timeout_s = config.timeout_ms / 1000
        self._redis = aioredis.from_url(
            config.url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s,
            retry_on_timeout=False, health_check_interval=0, decode_responses=True)
        self._admit = self._redis.register_script(_ADMIT)
        self._adjust = self._redis.register_script(_ADJUST)
        self._estimates = self._redis.register_script(_ESTIMATES)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._load = self._redis.register_script(_LOAD)
        self._load_prefix = "{" + prefix + "}:load:"
        self._prefixes_key = "{" + prefix + "}:prefixes"
        self._prefixes_read = "-"  # the last stream entry read ("-": none yet, read all)
        self.prefixes_sent = 0  # prompts this replica told the others of
        self.prefixes_learned = 0  # prompts the others told this one of
        self.sessions_sent = 0  # requests naming a session this replica told the others of
        self.sessions_learned = 0  # those the others told this one of
        self._pending: list[_Pending] = []
        # Each bucket's level as Redis last answered it, what an outage falls back to.
        self.levels: dict[tuple[ScopeKey, str], StoredLevel] = {}
        # Net charges this replica's own limiter took (an outage's admissions and their
        # settlements), owed to the shared buckets until a sync delivers them.
        self._owed: dict[tuple[ScopeKey, str], float] = {}
        # One beat at a time: two that both found the store back would both deliver the
        # outage's charges before either cleared them, spending them twice.
        self._beating = asyncio.Lock()
        # Until Redis first answers, this replica's share of every limit, long windows empty.
        self._fall_back()
        # The last total read per (pool, tier, tenant), and in which sync: a total not read
        # in the sync before is a new baseline (service elsewhere while the tenant had
        # nothing here is not held against it, as DRR keeps no credit for idle flows).
        self._seen: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._syncs_done = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        await self._beat()  # up (or down, with its log line) before the first request
        self._tasks = [asyncio.create_task(self._heartbeats(), name="shared:heartbeat"),
                       asyncio.create_task(self._syncs(), name="shared:sync")]

    async def stop(self) -> None:
        # The loops end on the flag as well as on the cancellation: a cancellation that
        # lands as a command's deadline expires can be swallowed in the client's call (seen
        # as a stop() that never returned), and the loop then ends at its next turn.
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                log.error("shared state: %s ended with %r", task.get_name(), task.exception())
        self._tasks.clear()
        if self.up:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._sync()  # what this replica still owes the shared buckets
                async with asyncio.timeout(max(self._timeout_s, 0.25)):
                    await self._redis.zrem(self._replicas_key, self.replica_id)
        await self._redis.aclose()

    def _mark(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.warning("shared state at %s reachable%s: limits and fairness are global "
                        "(%d replicas)", self._shown_url, " again" if self.errors else "",
                        self.replicas)
        else:
            self._fall_back()
            log.warning("shared state at %s unreachable (%s): each limit falls back to "
                        "1/%d of the configured in this replica, from the levels last read",
                        self._shown_url, why, max(1, self.replicas))
        if self.on_change is not None:
            self.on_change(up)

    def _fall_back(self) -> None:
        """This replica's own limiter: 1/N of every limit, each bucket at 1/N of the level
        Redis last answered, a day or month bucket never read empty (never a full one)."""
        self.replica.use_local_limits(1 / max(1, self.replicas), self.levels,
                                      time.time() - self.clock())

    def _read(self, specs: list[BucketSpec], now_s: str, levels: list[str]) -> None:
        """Keep the levels Redis answered (at its clock's ``now_s``) for a fallback."""
        if len(specs) != len(levels):
            return  # reloaded in between: the next answer tells
        at = float(now_s)
        for spec, level in zip(specs, levels, strict=True):
            key = (spec.scope, spec.name)
            last = self.levels.get(key)
            # Answers to concurrent calls arrive in any order: the script that ran last (on
            # Redis's clock; the lower level within one microsecond) is the level now.
            if last is not None and (last.at_s, -last.level) >= (at, -float(level)):
                continue
            period = None if spec.period is None else calendar_period(at, spec.period)[0]
            self.levels[key] = StoredLevel(spec.scope, spec.name, float(level), at,
                                           spec.capacity, spec.rate, period)

    def _failed(self, e: BaseException) -> None:
        self.errors += 1
        self._mark(False, type(e).__name__ + (f": {e}" if str(e) else ""))

    # ------------------------------------------------------------------ admission

    def buckets(self, tenant: str, endpoint: str, tier: str,
                model: str | None) -> list[BucketSpec]:
        return self.replica.buckets(tenant, endpoint, tier, model)

    async def admit(self, tenant: str, endpoint: str, tier: str, model: str | None,
                    tokens: int) -> Admit | Reject | None:
        """Check and take one request and ``tokens`` from every bucket that applies, in one
        round trip; None while the store is down (the core's own limiter decides)."""
        if not self.up:
            return None
        specs = self.buckets(tenant, endpoint, tier, model)
        if not specs:
            return Admit(tokens)
        keys = [bucket_key(self._prefix, s.scope, s.name) for s in specs]
        args: list[float] = []
        for spec in specs:
            args += _bucket_args(spec, 1 if spec.per_request else tokens)
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await self._admit(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            return None
        status = int(result[0])
        if status >= 0:
            self._read(specs, result[3], result[4:])
        if status == 1:
            return Admit(tokens)
        spec = specs[int(result[1]) - 1]
        amount = 1 if spec.per_request else tokens
        if status < 0:
            return Reject(RATE_LIMITED, None, f"request needs {amount} against {spec.name} "
                          f"{spec.capacity:g}; it can never fit")
        return Reject(RATE_LIMITED, float(result[2]), f"{spec.name} exhausted")

    # ------------------------------------------------------------------ sync

    async def _heartbeats(self) -> None:
        interval = self.config.heartbeat_ms / 1000
        while not self._stopping:
            await asyncio.sleep(interval)
            await self._beat()

    async def _beat(self) -> None:
        async with self._beating:
            await self._beat_once()

    async def _beat_once(self) -> None:
        expiry = HEARTBEATS_TO_EXPIRE * self.config.heartbeat_ms / 1000
        if not self.up and self.errors:
            # Down after an error: an idle pooled connection is from before the outage, and
            # a restarted server closed it, so the beat that should find the store back
            # would fail on it once (seen 1-2 replicas of 3 falling back to 1/N seconds
            # after Redis was back). Drop the idle ones, so the beat connects afresh; one in
            # use is another beat's, which its own failure, if any, closes.
            with contextlib.suppress(RedisError, OSError):
                await self._redis.connection_pool.disconnect(inuse_connections=False)
        try:
            async with asyncio.timeout(max(self._timeout_s, 0.25)):
                replicas = int(await self._heartbeat(keys=[self._replicas_key],
                                                     args=[self.replica_id, expiry]))
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            return
        changed = replicas != self.replicas and not self.up
        self.replicas = max(1, replicas)
        if changed:
            self._fall_back()  # the share of the N found (its charges still owed)
        if not self.up:
            # What the outage spent reaches the shared buckets before they admit again;
            # admissions during a delivery are local still, so deliver until none is left.
            while owed := self._owed_specs():
                try:
                    async with asyncio.timeout(max(self._timeout_s, 0.25)):
                        await self._deliver(owed)
                except (RedisError, OSError, TimeoutError) as e:
                    self._failed(e)
                    return
        self._mark(True)

    async def _deliver(self, owed: list[tuple[BucketSpec, float]]) -> None:
        levels = await self._adjust(
            keys=[bucket_key(self._prefix, s.scope, s.name) for s, _ in owed],
            args=[a for s, d in owed for a in _bucket_args(s, d)])
        self._owed.clear()
        self._read([s for s, _ in owed], levels[0], levels[1:])

    async def _syncs(self) -> None:
        interval = self.config.sync_ms / 1000
        # Load is what shares are judged on, and goes stale in milliseconds; service,
        # estimates and settlements move slowly, and cost a pipeline of several commands.
        every = max(1, round(SERVICE_SYNC_S / interval))
        for tick in itertools.count(1):
            if self._stopping:
                return
            await asyncio.sleep(interval)
            if tick % every == 0:
                await self._sync()
            elif self.up and self.replicas > 1:
                await self._exchange_load()

    async def _exchange_load(self) -> None:
        """This replica's load out, the others' back (alone, there is nothing to learn:
        its load goes out with the next full sync, before another replica counts it)."""
        try:
            async with asyncio.timeout(max(self._timeout_s * 4, 0.05)):
                foreign = await self._load(keys=self._load_keys(), args=self._load_args())
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            return
        self._adopt_load(foreign)

    def _load_keys(self) -> list[str]:
        return [self._replicas_key, self._load_prefix + self.replica_id]

    def _load_args(self) -> list[str | float]:
        args: list[str | float] = [
            self.replica_id, HEARTBEATS_TO_EXPIRE * self.config.heartbeat_ms,
            self._load_prefix]
        for (pool, tenant), (inflight, backlogged) in self.replica.local_load().items():
            args += [_field(pool, tenant), f"{inflight},{int(backlogged)}"]
        return args

    def _adopt_load(self, foreign: list[str]) -> None:
        self.replica.set_foreign_load({
            (pool, tenant): (int(foreign[i + 1]), int(foreign[i + 2]) > 0)
            for i in range(0, len(foreign), 3)
            for pool, tenant in [_unfield(foreign[i])]})

    async def _sync(self) -> None:
        """One full exchange: charges owed, this replica's service, load and estimates'
        observations; back come the totals of the tenants queued here, the others' load
        and the shared estimates."""
        out = self._take()
        if not self.up:
            # Service and estimates while down stay this replica's own: when Redis is back,
            # the others judge from its totals as they stand then.
            self.replica.set_foreign_load({})
            return
        owed = self._owed_specs()
        wanted = sorted(set(out.booked) | set(self.replica.queued_flows()))
        pending, self._pending = self._pending, []
        try:
            async with asyncio.timeout(max(self._timeout_s * 4, 0.05)):
                async with self._redis.pipeline(transaction=False) as pipe:
                    await self._queue_sync(pipe, out, pending, owed, wanted)
                    results = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._pending = pending + self._pending  # owed still, in order
            self._failed(e)
            return
        self._owed.clear()  # delivered
        for charge, levels in zip(pending, results, strict=False):
            specs = self._charge_specs(charge)
            if specs:
                self._read(specs, levels[0], levels[1:])
        if owed:
            levels = results[len(pending)]
            self._read([s for s, _ in owed], levels[0], levels[1:])
        self._syncs_done += 1
        self._read_exchange(results[len(pending) + bool(owed) + len(out.booked):], out, wanted)

    def _take(self) -> _Outgoing:
        """What this replica owes the others since the last sync (charges join the
        pending ones, the oldest dropped past MAX_PENDING_CHARGES)."""
        replica = self.replica
        for request, delta in replica.take_charges():
            self._pending.append(_Pending(request, delta))
        if len(self._pending) > MAX_PENDING_CHARGES:
            self.dropped_charges += len(self._pending) - MAX_PENDING_CHARGES
            del self._pending[:len(self._pending) - MAX_PENDING_CHARGES]
        # Prompts sent while down are lost: only cache hits elsewhere, and the others then
        # see this replica's prompts as unseen clients'.
        return _Outgoing(replica.take_booked(), replica.take_observations(),
                         replica.take_sent_prefixes(), replica.take_sent_tokens(),
                         replica.take_sent_sessions())

    async def _queue_sync(self, pipe: Any, out: _Outgoing, pending: list[_Pending],
                          owed: list[tuple[BucketSpec, float]],
                          wanted: list[tuple[str, str, str]]) -> None:
        """One sync's commands on the pipeline, in the order ``_read_exchange`` reads
        their answers."""
        for charge in pending:
            await self._queue_adjust(pipe, charge)
        if owed:
            await self._adjust(
                keys=[bucket_key(self._prefix, s.scope, s.name) for s, _ in owed],
                args=[a for s, d in owed for a in _bucket_args(s, d)], client=pipe)
        for key, turns in out.booked.items():
            pipe.hincrbyfloat(self._served_key, _field(*key), turns)
        if wanted:
            pipe.hmget(self._served_key, [_field(*key) for key in wanted])
        await self._load(keys=self._load_keys(), args=self._load_args(), client=pipe)
        if out.observations:
            args: list[str | float] = [self.replica.estimate_alpha]
            for tenant, endpoint, model, tokens in out.observations:
                args += [_field(tenant, endpoint, model), tokens]
            # Queued on the pipeline (a script call on a pipeline only queues).
            await self._estimates(keys=[self._estimates_key], args=args, client=pipe)
        if out.sent or out.sent_tokens or out.observations or out.sessions:
            # The outputs and the sessions bound ride with the prompts: every replica's
            # history of recent outputs (decision 0018) holds everyone's, and each replica's
            # session_affinity binds the others' programs.
            pipe.xadd(self._prefixes_key, {"r": self.replica_id,
                                           "d": orjson.dumps(out.sent).decode(),
                                           "t": orjson.dumps(out.sent_tokens).decode(),
                                           "o": orjson.dumps(out.observations).decode(),
                                           "s": orjson.dumps(out.sessions).decode()},
                      maxlen=PREFIX_STREAM_LEN, approximate=True)
        start = self._prefixes_read
        pipe.xrange(self._prefixes_key, min=start if start == "-" else f"({start}",
                    count=PREFIX_READ_COUNT)

    def _read_exchange(self, results: list[Any], out: _Outgoing,
                       wanted: list[tuple[str, str, str]]) -> None:
        """The answers after the settlements: service totals, load, estimates, prompts."""
        replica = self.replica
        if wanted:
            totals = results.pop(0)
            for key, total in zip(wanted, totals, strict=True):
                now_total = 0.0 if total is None else float(total)  # none served yet
                last = self._seen.get(key)
                self._seen[key] = (self._syncs_done, now_total)
                if last is not None and last[0] == self._syncs_done - 1:
                    foreign = now_total - last[1] - out.booked.get(key, 0.0)
                    if abs(foreign) > 1e-9:
                        replica.charge_foreign(*key, foreign)
        self._adopt_load(results.pop(0))
        if out.observations:
            shared = results.pop(0)
            for i in range(0, len(shared), 2):
                tenant, endpoint, model = _unfield(shared[i])
                replica.adopt_estimate(tenant, endpoint, float(shared[i + 1]), model)
        if out.sent or out.sent_tokens or out.observations or out.sessions:
            results.pop(0)  # the new entry's id
            self.prefixes_sent += len(out.sent)
            self.sessions_sent += len(out.sessions)
        self._learn_prefixes(results.pop(0))

    def _learn_prefixes(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        """The others' entries of the stream of prompts sent, into this replica's indexes."""
        for entry_id, fields in entries:
            self._prefixes_read = entry_id
            if fields.get("r") == self.replica_id:
                continue
            try:
                sent = orjson.loads(fields["d"])
                for backend, block_size, blocks in sent:
                    self.replica.learn_sent_prefix(backend, block_size, blocks)
                # An entry of an older replica has no tokens: its prompts go unseen.
                tokens = orjson.loads(fields.get("t", "{}"))
                now = self.clock()
                for backend, n in tokens.items():
                    self.replica.learn_sent_tokens(backend, int(n), now)
                # An entry of an older replica has no outputs: its answers go unseen here.
                self.replica.learn_outputs([
                    (str(t), str(e), str(m), int(n))
                    for t, e, m, n in orjson.loads(fields.get("o", "[]"))])
                # Bound when told: the replicas' clocks never meet, and the binding is at
                # most one sync old.
                sessions = orjson.loads(fields.get("s", "[]"))
                for tenant, session, backend in sessions:
                    self.replica.learn_session(str(tenant), str(session), str(backend), now)
                self.sessions_learned += len(sessions)
            except (KeyError, ValueError, TypeError, AttributeError):
                continue  # not an entry of ours (another version): nothing to learn
            self.prefixes_learned += len(sent)

    def _charge_specs(self, charge: _Pending) -> list[BucketSpec]:
        r = charge.request
        return [s for s in self.buckets(r.tenant, r.endpoint, r.tier, r.model)
                if not s.per_request]

    def _owed_specs(self) -> list[tuple[BucketSpec, float]]:
        """The buckets owed a charge (this replica's own limiter's, taken now), as the
        limits in force size them (one a reload removed is owed nothing: its key expires as
        it is)."""
        for bucket, charged in self.replica.take_local_charges().items():
            self._owed[bucket] = self._owed.get(bucket, 0.0) + charged
        table = self.replica.limit_table
        out = []
        for (scope, name), delta in self._owed.items():
            spec = table.bucket(scope, name)
            if spec is not None and abs(delta) > 1e-9:
                out.append((spec, delta))
        return out

    async def _queue_adjust(self, pipe: aioredis.client.Pipeline, charge: _Pending) -> None:
        specs = self._charge_specs(charge)
        if not specs:
            pipe.echo("")  # keep one result per charge
            return
        await self._adjust(keys=[bucket_key(self._prefix, s.scope, s.name) for s in specs],
                           args=[a for s in specs for a in _bucket_args(s, charge.delta)],
                           client=pipe)

    # ------------------------------------------------------------------ views

    @property
    def pending_charges(self) -> int:
        return len(self._pending)

    def snapshot(self) -> dict[str, object]:
        return {"backend": "redis", "up": self.up, "replica": self.replica_id,
                "replicas": self.replicas, "pending_charges": len(self._pending),
                "owed_buckets": len(self._owed), "levels_read": len(self.levels),
                "dropped_charges": self.dropped_charges, "errors": self.errors,
                "prefixes_sent": self.prefixes_sent, "prefixes_learned": self.prefixes_learned,
                "sessions_sent": self.sessions_sent, "sessions_learned": self.sessions_learned}



class SharedStateCollector:
    """The shared state's health on /metrics; a replica with in-process state (one replica)
    exports it too, always up, so dashboards and alerts need no special case."""

    def __init__(self, shared: SharedState | None) -> None:
        self.shared = shared

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        shared = self.shared
        up = GaugeMetricFamily("weighbridge_shared_state_up",
                               "1 while the state replicas share is reachable (always 1 "
                               "with state in process); 0: limits are 1/N of the configured.")
        up.add_metric([], 1 if shared is None or shared.up else 0)
        replicas = GaugeMetricFamily("weighbridge_shared_state_replicas",
                                     "Replicas registered with the shared state (itself "
                                     "included; 1 with state in process).")
        replicas.add_metric([], 1 if shared is None else shared.replicas)
        errors = CounterMetricFamily("weighbridge_shared_state_errors",
                                     "Round trips to the shared state that failed or timed "
                                     "out.")
        errors.add_metric([], 0 if shared is None else shared.errors)
        pending = GaugeMetricFamily("weighbridge_shared_state_pending_charges",
                                    "Settlements and refunds not yet sent to the shared "
                                    "rate-limit buckets.")
        pending.add_metric([], 0 if shared is None else shared.pending_charges)
        yield from (up, replicas, errors, pending)
