"""Rate limits as continuously refilling token buckets, in four scopes: a tier (all its
tenants together), a tenant, a tenant on one endpoint and a tenant on one model. The last
two come from the tenant's own entry or, without one, from the endpoint's or model's
default for every tenant (each tenant then gets its own buckets of that size).

Every window is a bucket of ``capacity = limit`` refilled at ``limit / window`` per second by
default (``windows: rolling``), so a tenant may burst one window's worth and then proceeds at
the average rate; the month is 30 days. With ``windows: calendar`` the day and month limits
are calendar windows instead: the bucket is full again at the start of each UTC day or month
(a debt carries over) and does not refill in between. The worst case of each, in any span
of one window's length: a rolling bucket admits up to two limits (a full bucket, then a
window's refill), as does a calendar window straddling its reset; within one calendar month
a rolling month admits up to ``limit * (1 + days/30)``, a calendar month exactly its limit.
The minute windows are always rolling. ``now`` is the caller's monotonic clock; the UTC
calendar is ``now + wall_offset_s``, an offset the shell measures once.

Durable levels (``durable=True``): the day and month levels outlive the process, in a store
the shell keeps (``sidecar.quotas``: SQLite). The store must hold a level at most the
bucket's true level at all times, so that a crash hands out nothing: ``reservations`` says
which levels the store must hold *before* a request may take its amount (each written
``reserve_ahead`` of the limit further down, in whole requests or tokens, so that one write
covers many admissions). A caller that admits without reserving first (a front that does
not) has its admission written behind it instead, as settlements and refunds, which move
the level after the fact, are: ``unsaved`` lists the levels to write behind them. A bucket
met again is ``restored`` from the store's level, refilled by the wall-clock time since it
was written.

Token limits charge the *estimate* (prompt + expected output) at admission and are settled
with the real count at the end (``limited_tokens``: a prompt token the engine found cached
counts its endpoint's or tier's ``cached_prompt_token_weight``, 1 by default). Settlement may
drive a bucket negative: that debt is how a tenant that under-estimated pays, by waiting
longer for its next admission.

Reload (``TenantRateLimiter.retable``, sidecar.reload): a bucket whose scope and window
survive a new configuration keeps what was spent from it, ``capacity - level``, and takes the
new size: a raised limit adds the difference to the level, a lowered one takes it away (the
level may go negative, a debt the tenant waits out). A new scope or window starts full, as
a first use does; a scope or window the configuration no longer has is dropped.

Refund policy (``refund``): a request that passed the limiter but is then turned away before it
reaches a backend (queue full, deadline unmeetable) or cancelled while queued gets its tokens
back, since no tokens were produced; its *request* charge is kept, so ``requests_per_minute``
still bounds how fast a tenant may hit the sidecar. A request that reached a backend is
settled with what was actually consumed instead (see ``settle``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from weighbridge.sidecar.rejection import RATE_LIMITED, Reject

MINUTE_S = 60.0
DAY_S = 86_400.0
MONTH_S = 30 * DAY_S

# Refill is float arithmetic: waiting exactly the Retry-After we returned may leave the level a
# few ulps short of the amount, and that must not produce a second, microscopic Retry-After.
_TOLERANCE = 1e-9


class RateLimits(Protocol):
    """The rate fields of ``weighbridge.sidecar.config.Limits`` (None = unlimited)."""

    requests_per_minute: int | None
    requests_per_day: int | None
    requests_per_month: int | None
    tokens_per_minute: int | None
    tokens_per_day: int | None
    tokens_per_month: int | None
    windows: Literal["rolling", "calendar"]


# A scope's identity: ("tier", tier), ("tenant", tenant), ("endpoint", tenant, endpoint) or
# ("model", tenant, model). The same key names a scope's buckets here and in a shared store.
ScopeKey = tuple[str, ...]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# A calendar period: a UTC day or a UTC month.
Period = Literal["day", "month"]

# (Limits field, window seconds, charged in requests rather than tokens, its calendar period:
# None for the minute, always rolling)
_WINDOWS: tuple[tuple[str, float, bool, Period | None], ...] = (
    ("requests_per_minute", MINUTE_S, True, None),
    ("requests_per_day", DAY_S, True, "day"),
    ("requests_per_month", MONTH_S, True, "month"),
    ("tokens_per_minute", MINUTE_S, False, None),
    ("tokens_per_day", DAY_S, False, "day"),
    ("tokens_per_month", MONTH_S, False, "month"),
)
# The windows whose levels outlive the process (the long ones).
LONG_WINDOWS = frozenset(name for name, _, _, period in _WINDOWS if period is not None)


def calendar_period(wall_s: float, period: Period) -> tuple[int, float]:
    """The UTC calendar period holding ``wall_s`` (seconds since the epoch): its index (days,
    or months, since the epoch's) and when the next one starts."""
    day = int(wall_s // DAY_S)
    if period == "day":
        return day, (day + 1) * DAY_S
    # From the day's index, not the instant: a float a hair before midnight is that day's.
    at = _EPOCH + timedelta(days=day)
    index = (at.year - 1970) * 12 + at.month - 1
    year, month = divmod(index + 1, 12)
    return index, datetime(1970 + year, month + 1, 1, tzinfo=UTC).timestamp()


@dataclass(frozen=True, slots=True)
class StoredLevel:
    """One long-window bucket's level as a store holds it: at wall-clock ``at_s``, of a bucket
    of ``capacity`` refilled at ``rate`` (0: a calendar window, in period ``period``)."""

    scope: ScopeKey
    name: str
    level: float
    at_s: float
    capacity: float
    rate: float
    period: int | None = None


def restored_level(stored: StoredLevel, capacity: float, wall_s: float,
                   period: int | None) -> float:
    """What a stored level is worth at ``wall_s`` in a bucket of ``capacity`` (calendar
    period ``period``, None: rolling): refilled as it was stored, then resized by the
    capacity's change (the "Reload" rule); a calendar window begun since is full, less any
    debt."""
    level = stored.level
    if stored.period is not None and period is not None:
        if period != stored.period:
            level = stored.capacity + min(0.0, level)
    elif wall_s > stored.at_s:
        level = min(stored.capacity, level + (wall_s - stored.at_s) * stored.rate)
    return level + (capacity - stored.capacity)


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    rate: float  # refill per second; 0 for a calendar window
    level: float
    updated_s: float
    # A calendar window: full again at the start of each UTC day or month, read on the wall
    # clock ``now + wall_offset_s``; None: a rolling bucket.
    period: Period | None = None
    wall_offset_s: float = 0.0
    index: int = 0  # the calendar period ``level`` belongs to
    # The level a durable store holds, refilled alike (module doc); None: not kept.
    durable: float | None = None
    durable_at: float = 0.0  # when that level was written (on this clock)

    @classmethod
    def full(cls, limit: float, window_s: float, now: float) -> TokenBucket:
        return cls(capacity=float(limit), rate=limit / window_s, level=float(limit), updated_s=now)

    @classmethod
    def calendar(cls, limit: float, period: Period, now: float,
                 wall_offset_s: float) -> TokenBucket:
        index, _ = calendar_period(now + wall_offset_s, period)
        return cls(capacity=float(limit), rate=0.0, level=float(limit), updated_s=now,
                   period=period, wall_offset_s=wall_offset_s, index=index)

    def period_index(self, now: float) -> int | None:
        """The calendar period at ``now`` (None: a rolling bucket)."""
        if self.period is None:
            return None
        return calendar_period(now + self.wall_offset_s, self.period)[0]

    def refill(self, now: float) -> None:
        # A clock that steps backwards (it should not: callers pass a monotonic clock) must
        # not drain the bucket; time simply stands still until it catches up.
        if now <= self.updated_s:
            return
        if self.period is not None:
            index, _ = calendar_period(now + self.wall_offset_s, self.period)
            if index > self.index:
                self.index = index
                self.level = self.capacity + min(0.0, self.level)
                if self.durable is not None:
                    self.durable = self.capacity + min(0.0, self.durable)
        else:
            gained = (now - self.updated_s) * self.rate
            self.level = min(self.capacity, self.level + gained)
            if self.durable is not None:
                self.durable = min(self.capacity, self.durable + gained)
        self.updated_s = now

    def wait_s(self, amount: float, now: float) -> float | None:
        """Seconds until ``amount`` fits, 0 if it fits now, None if it never fits."""
        self.refill(now)
        if amount > self.capacity * (1 + _TOLERANCE):
            return None
        missing = amount - self.level
        if missing <= _TOLERANCE * max(1.0, amount):
            return 0.0
        if self.period is not None:
            wall = now + self.wall_offset_s
            _, next_s = calendar_period(wall, self.period)
            # The next reset (a debt deeper than the capacity is still short after it, and
            # that answer then names the reset after).
            return max(next_s - wall, _TOLERANCE)
        return missing / self.rate

    def covered(self, amount: float, now: float) -> bool:
        """Whether taking ``amount`` keeps the level at or above what the store holds. A
        full bucket does not refill while the stored level does: the refill since the level
        was written is the store's to keep (a crash may return those milliseconds' worth)."""
        self.refill(now)
        if self.durable is None:
            return True
        slack = _TOLERANCE * max(1.0, amount) + self.rate * max(0.0, now - self.durable_at)
        return self.level - amount >= self.durable - slack

    def take(self, amount: float, now: float) -> None:
        """Charge unconditionally; the level may go negative (debt)."""
        self.refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> float:
        """Return a charge; never above capacity, so refunds cannot bank a bigger burst.
        Returns what was given back."""
        self.refill(now)
        given = max(0.0, min(amount, self.capacity - self.level))
        self.level += given
        return given

    def snapshot(self, now: float) -> dict[str, Any]:
        self.refill(now)
        out: dict[str, Any] = {"level": self.level, "capacity": self.capacity,
                               "rate_per_s": self.rate}
        if self.period is not None:
            out["resets_at"] = calendar_period(now + self.wall_offset_s, self.period)[1]
        if self.durable is not None:
            out["stored_level"] = self.durable
        return out


@dataclass(frozen=True, slots=True)
class BucketSettings:
    """How a limiter makes its buckets: every limit times ``scale``; the wall clock as
    ``now + wall_offset_s``; ``restored``: levels a store held (a bucket with one starts
    there, refilled since); ``durable``: long-window levels are kept in a store (the file's,
    ``restored`` at start); ``unseen_long_empty``: a long-window bucket
    with no stored level starts empty rather than full (a fallback that must never hand out
    a full month it cannot see)."""

    scale: float = 1.0
    wall_offset_s: float = 0.0
    durable: bool = False
    restored: Mapping[tuple[ScopeKey, str], StoredLevel] = field(default_factory=dict)
    unseen_long_empty: bool = False


@dataclass(slots=True)
class _Scope:
    """The buckets of one scope: a tier, a tenant, or a tenant on one endpoint or model."""

    requests: list[tuple[str, TokenBucket]] = field(default_factory=list)
    tokens: list[tuple[str, TokenBucket]] = field(default_factory=list)

    @classmethod
    def from_limits(cls, limits: RateLimits, now: float, scale: float = 1.0,
                    key: ScopeKey = (), settings: BucketSettings | None = None) -> _Scope:
        settings = settings or BucketSettings(scale=scale)
        scale = settings.scale
        calendar = getattr(limits, "windows", "rolling") == "calendar"
        scope = cls()
        for name, window_s, per_request, period in _WINDOWS:
            limit = getattr(limits, name)
            if limit is None:
                continue
            bucket = (TokenBucket.calendar(limit * scale, period, now, settings.wall_offset_s)
                      if calendar and period is not None
                      else TokenBucket.full(limit * scale, window_s, now))
            stored = settings.restored.get((key, name))
            if stored is not None:
                wall = now + settings.wall_offset_s
                bucket.level = min(bucket.capacity, scale * restored_level(
                    stored, limit, wall, bucket.period_index(now)))
            elif period is not None and settings.unseen_long_empty:
                bucket.level = 0.0
            if period is not None and settings.durable:
                bucket.durable = bucket.level
            (scope.requests if per_request else scope.tokens).append((name, bucket))
        return scope

    def named(self, name: str) -> TokenBucket | None:
        for bucket_name, bucket in (*self.requests, *self.tokens):
            if bucket_name == name:
                return bucket
        return None


@dataclass(frozen=True, slots=True)
class Admit:
    tokens: int  # the token estimate charged; pass it back to settle() or refund()


def _limits_anything(limits: RateLimits) -> bool:
    return any(getattr(limits, name) is not None for name, _, _, _ in _WINDOWS)



@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket a request is charged to: its scope, its window, its size."""

    scope: ScopeKey
    name: str  # the Limits field, e.g. "tokens_per_minute"
    capacity: float
    rate: float  # refill per second (a calendar window's is the rolling one's, unused)
    per_request: bool  # charged one per request, rather than tokens
    period: Period | None = None  # a calendar window's period; None: a rolling bucket


class LimitTable:
    """Which limits apply to a request: the configuration resolved, with no state. Its tier's
    (all tenants in the tier together), its tenant's, its tenant's on its endpoint and on its
    model, the last two from the tenant's own entry or else the endpoint's or model's
    default for every tenant. ``TenantRateLimiter`` keeps the buckets in process; a shared
    store (sidecar.shared) keeps the same buckets, by the same keys, for every replica."""

    def __init__(
        self,
        limits: Mapping[str, RateLimits],
        endpoint_limits: Mapping[tuple[str, str], RateLimits] | None = None,
        tier_limits: Mapping[str, RateLimits] | None = None,
        *,
        endpoint_defaults: Mapping[str, RateLimits] | None = None,
        model_limits: Mapping[tuple[str, str], RateLimits] | None = None,
        model_defaults: Mapping[str, RateLimits] | None = None,
    ) -> None:
        self._tenants = {k: v for k, v in limits.items() if _limits_anything(v)}
        self._tiers = {k: v for k, v in (tier_limits or {}).items() if _limits_anything(v)}
        self._endpoints = dict(endpoint_limits or {})
        self._endpoint_defaults = {k: v for k, v in (endpoint_defaults or {}).items()
                                   if _limits_anything(v)}
        self._models = dict(model_limits or {})
        self._model_defaults = {k: v for k, v in (model_defaults or {}).items()
                                if _limits_anything(v)}

    def scopes(self, tenant: str, endpoint: str, tier: str | None,
               model: str | None) -> list[tuple[ScopeKey, RateLimits]]:
        out: list[tuple[ScopeKey, RateLimits]] = []
        if tier is not None and tier in self._tiers:
            out.append((("tier", tier), self._tiers[tier]))
        if tenant in self._tenants:
            out.append((("tenant", tenant), self._tenants[tenant]))
        limits = self._endpoints.get((tenant, endpoint)) or self._endpoint_defaults.get(endpoint)
        if limits is not None:
            out.append((("endpoint", tenant, endpoint), limits))
        if model is not None:
            limits = self._models.get((tenant, model)) or self._model_defaults.get(model)
            if limits is not None:
                out.append((("model", tenant, model), limits))
        return out

    def keeps_long_windows(self) -> bool:
        """Whether any scope has a day or month limit."""
        every = (*self._tenants.values(), *self._tiers.values(), *self._endpoints.values(),
                 *self._endpoint_defaults.values(), *self._models.values(),
                 *self._model_defaults.values())
        return any(getattr(limits, name) is not None for limits in every
                   for name in LONG_WINDOWS)

    def limits_for(self, scope: ScopeKey) -> RateLimits | None:
        """The limits of one scope (as ``scopes`` names it), or None if none applies."""
        kind, owner, *thing = scope
        if kind == "tier":
            return self._tiers.get(owner)
        if kind == "tenant":
            return self._tenants.get(owner)
        if kind == "endpoint":
            return self._endpoints.get((owner, thing[0])) or self._endpoint_defaults.get(
                thing[0])
        return self._models.get((owner, thing[0])) or self._model_defaults.get(thing[0])

    def bucket(self, scope: ScopeKey, name: str) -> BucketSpec | None:
        """One bucket of one scope as the limits in force size it; None: no such limit."""
        limits = self.limits_for(scope)
        for field_name, window_s, per_request, period in _WINDOWS:
            if field_name == name and limits is not None:
                limit = getattr(limits, name)
                if limit is None:
                    return None
                calendar = getattr(limits, "windows", "rolling") == "calendar"
                return BucketSpec(scope, name, float(limit), limit / window_s, per_request,
                                  period if calendar else None)
        return None

    def buckets(self, tenant: str, endpoint: str, tier: str | None,
                model: str | None) -> list[BucketSpec]:
        """Every bucket of every scope that applies, requests before tokens in each."""
        return [BucketSpec(key, name, float(limit), limit / window_s, per_request,
                           period if getattr(limits, "windows", "rolling") == "calendar"
                           else None)
                for key, limits in self.scopes(tenant, endpoint, tier, model)
                for name, window_s, per_request, period in _WINDOWS
                if (limit := getattr(limits, name)) is not None]


def limited_tokens(prompt_tokens: int, output_tokens: int, cached_tokens: int,
                   cached_weight: float) -> int:
    """The tokens a request's token limits count: every output token, every prompt token
    the engine computed, and ``cached_weight`` (0-1) of each it found cached; the discount
    is rounded down, so a fraction of a token is charged."""
    cached = max(0, min(cached_tokens, prompt_tokens))
    return prompt_tokens + output_tokens - int((1.0 - cached_weight) * cached)


class TenantRateLimiter:
    """Admission against every limit that applies to a request (its ``LimitTable``),
    atomically: either all its buckets are charged or none is. ``scale`` multiplies every
    limit (a replica's share of limits it cannot coordinate, sidecar.shared); ``settings``
    says how buckets are made (``BucketSettings``: the wall clock, durable levels).
    ``reserve_ahead``: the part of a long-window limit a reservation writes beyond the
    request's own amount (module doc). ``ledger``: keep the net amount charged to every
    bucket, for a shared store to take (``take_charged``)."""

    def __init__(self, table: LimitTable, *, scale: float = 1.0,
                 settings: BucketSettings | None = None, reserve_ahead: float = 0.0,
                 ledger: bool = False) -> None:
        settings = settings or BucketSettings(scale=scale)
        if not settings.scale > 0:
            raise ValueError("scale must be positive")
        if not 0 <= reserve_ahead <= 1:
            raise ValueError("reserve_ahead must be within 0-1")
        self.table = table
        self.settings = settings
        self._reserve_ahead = reserve_ahead
        # Buckets are created on first use: 10,000 configured tenants cost nothing until
        # they send. A new bucket starts full (or at its stored level), which is what a
        # bucket created at startup would have refilled to anyway.
        self._scopes_by_key: dict[ScopeKey, _Scope] = {}
        self._charged: dict[tuple[ScopeKey, str], float] | None = {} if ledger else None

    @property
    def wall_offset_s(self) -> float:
        return self.settings.wall_offset_s

    def _scope(self, key: ScopeKey, limits: RateLimits, now: float) -> _Scope:
        scope = self._scopes_by_key.get(key)
        if scope is None:
            scope = self._scopes_by_key[key] = _Scope.from_limits(
                limits, now, key=key, settings=self.settings)
        return scope

    def _keyed(self, tenant: str, endpoint: str, now: float, tier: str | None,
               model: str | None) -> list[tuple[ScopeKey, _Scope]]:
        return [(key, self._scope(key, limits, now))
                for key, limits in self.table.scopes(tenant, endpoint, tier, model)]

    def retable(self, table: LimitTable, now: float) -> None:
        """Take a new configuration's limits, keeping what was spent (module doc, "Reload")."""
        scopes: dict[ScopeKey, _Scope] = {}
        for key, old in self._scopes_by_key.items():
            limits = table.limits_for(key)
            if limits is None or not _limits_anything(limits):
                continue
            new = scopes[key] = _Scope.from_limits(limits, now, key=key,
                                                   settings=self.settings)
            for name, bucket in (*new.requests, *new.tokens):
                was = old.named(name)
                if was is None:
                    continue
                was.refill(now)
                bucket.level = bucket.capacity - (was.capacity - was.level)
                if was.durable is not None and bucket.durable is not None:
                    bucket.durable = bucket.capacity - (was.capacity - was.durable)
        self.table = table
        self._scopes_by_key = scopes

    def _charge(self, key: ScopeKey, name: str, amount: float) -> None:
        if self._charged is not None and amount:
            self._charged[(key, name)] = self._charged.get((key, name), 0.0) + amount

    def take_charged(self) -> dict[tuple[ScopeKey, str], float]:
        """The net amount charged to each bucket since the last call (``ledger``): what a
        shared store that was out of reach has still to be told."""
        taken, self._charged = self._charged or {}, ({} if self._charged is not None
                                                    else None)
        return taken

    # ------------------------------------------------------------------ durable levels

    def _stored(self, key: ScopeKey, name: str, bucket: TokenBucket, level: float,
                now: float) -> StoredLevel:
        scale = self.settings.scale
        return StoredLevel(key, name, level / scale, now + self.settings.wall_offset_s,
                           bucket.capacity / scale, bucket.rate / scale,
                           bucket.period_index(now))

    def _ahead(self, bucket: TokenBucket) -> float:
        """What a reservation writes beyond the amount: whole requests or tokens, so that a
        crash costs none of a small limit (12 a month: 0, not 0.12 that rounds to one)."""
        return float(math.floor(self._reserve_ahead * bucket.capacity))

    def keeps_levels(self, tenant: str, endpoint: str, tier: str | None,
                     model: str | None) -> bool:
        """Whether a request draws on a level the store keeps (a day or month limit of a
        durable limiter): only such a request needs ``reservations``."""
        return self.settings.durable and any(
            getattr(limits, name) is not None
            for _, limits in self.table.scopes(tenant, endpoint, tier, model)
            for name in LONG_WINDOWS)

    def reservations(self, tenant: str, endpoint: str, tokens: int, now: float,
                     tier: str | None = None, model: str | None = None) -> list[StoredLevel]:
        """The levels the store must hold before this request may be admitted: empty when
        the levels it holds already cover it, or when it will not be admitted anyway."""
        writes: list[StoredLevel] = []
        for key, scope in self._keyed(tenant, endpoint, now, tier, model):
            for amount, buckets in ((1, scope.requests), (tokens, scope.tokens)):
                for name, bucket in buckets:
                    if bucket.wait_s(amount, now) != 0.0:
                        return []
                    if bucket.covered(amount, now):
                        continue
                    after = bucket.level - amount
                    target = max(after - self._ahead(bucket), min(0.0, after))
                    writes.append(self._stored(key, name, bucket, target, now))
        return writes

    def stored(self, levels: Sequence[StoredLevel], now: float) -> None:
        """The store now holds ``levels`` (written as ``reservations`` or ``unsaved`` said)."""
        for stored in levels:
            scope = self._scopes_by_key.get(stored.scope)
            bucket = None if scope is None else scope.named(stored.name)
            if bucket is None or bucket.durable is None:
                continue  # reloaded away meanwhile
            bucket.refill(now)
            scale = self.settings.scale
            bucket.durable = scale * restored_level(
                stored, bucket.capacity / scale, now + self.settings.wall_offset_s,
                bucket.period_index(now))
            bucket.durable_at = stored.at_s - self.settings.wall_offset_s

    def unsaved(self, now: float, *, exact: bool = False) -> list[StoredLevel]:
        """The levels to write behind settlements and refunds: a bucket whose level fell
        below what the store holds (a debt: the store would hand it out again after a
        crash) or rose well above it (refunds: a crash would lose them); ``exact``: every
        level that differs, as it is (a stop)."""
        out: list[StoredLevel] = []
        for key, scope in self._scopes_by_key.items():
            for name, bucket in (*scope.requests, *scope.tokens):
                if bucket.durable is None:
                    continue
                bucket.refill(now)
                gap = bucket.level - bucket.durable
                if exact:
                    if abs(gap) > _TOLERANCE:
                        out.append(self._stored(key, name, bucket, bucket.level, now))
                elif gap < -_TOLERANCE:
                    out.append(self._stored(key, name, bucket, bucket.level, now))
                elif gap > max(1.0, 2 * self._ahead(bucket)):
                    target = bucket.level - self._ahead(bucket)
                    out.append(self._stored(key, name, bucket, target, now))
        return out

    def admit(self, tenant: str, endpoint: str, tokens: int, now: float,
              tier: str | None = None, model: str | None = None) -> Admit | Reject:
        """Charge one request and ``tokens`` (the estimate) or say how long to wait."""
        keyed = self._keyed(tenant, endpoint, now, tier, model)
        wait = 0.0
        binding = ""
        for _, scope in keyed:
            for amount, buckets in ((1, scope.requests), (tokens, scope.tokens)):
                for name, bucket in buckets:
                    needed = bucket.wait_s(amount, now)
                    if needed is None:
                        return Reject(
                            RATE_LIMITED,
                            None,
                            f"request needs {amount} against {name} {bucket.capacity:g}; "
                            "it can never fit",
                        )
                    if needed > wait:
                        wait, binding = needed, name
        if wait > 0:
            # Each bucket refills independently, so after the longest wait every bucket holds
            # enough: the binding bucket's wait is the exact Retry-After.
            return Reject(RATE_LIMITED, wait, f"{binding} exhausted")
        for key, scope in keyed:
            for amount, buckets in ((1, scope.requests), (tokens, scope.tokens)):
                for name, bucket in buckets:
                    bucket.take(amount, now)
                    self._charge(key, name, amount)
        return Admit(tokens)

    def settle(self, tenant: str, endpoint: str, estimated: int, actual: int, now: float,
               tier: str | None = None, model: str | None = None) -> None:
        """Correct the token charge to the real count: extra charge (possibly into debt) when
        the estimate was low, a refund when it was high."""
        delta = actual - estimated
        if delta == 0:
            return
        for key, scope in self._keyed(tenant, endpoint, now, tier, model):
            for name, bucket in scope.tokens:
                if delta > 0:
                    bucket.take(delta, now)
                    self._charge(key, name, delta)
                else:
                    self._charge(key, name, -bucket.give(-delta, now))

    def refund(self, tenant: str, endpoint: str, tokens: int, now: float,
               tier: str | None = None, model: str | None = None) -> None:
        """Give back the token charge of a request that produced nothing (see module doc)."""
        for key, scope in self._keyed(tenant, endpoint, now, tier, model):
            for name, bucket in scope.tokens:
                self._charge(key, name, -bucket.give(tokens, now))

    def snapshot(self, now: float) -> dict[str, Any]:
        out: dict[str, dict[str, Any]] = {"tenants": {}, "endpoints": {}, "models": {},
                                          "tiers": {}}
        for key, scope in self._scopes_by_key.items():
            dump = {name: b.snapshot(now) for name, b in (*scope.requests, *scope.tokens)}
            kind, owner, *thing = key
            if thing:
                out[kind + "s"].setdefault(owner, {})[thing[0]] = dump
            else:
                out[kind + "s"][owner] = dump
        return out
