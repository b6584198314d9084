"""Rate limits as continuously refilling token buckets, in four scopes: a tier (all its
tenants together), a tenant, a tenant on one endpoint and a tenant on one model. The last
two come from the tenant's own entry or, without one, from the endpoint's or model's
default for every tenant (each tenant then gets its own buckets of that size).

Every window is a bucket of ``capacity = limit`` refilled at ``limit / window`` per second, so a
tenant may burst one window's worth and then proceeds at the average rate. The long windows
(day, month = 30 days) are buckets too rather than calendar windows: the core has no calendar
(``now`` is a monotonic clock), buckets need no reset job, and both schemes admit at most two
windows' worth in the worst window (a calendar window at its boundary, a bucket after a
full-bucket burst), so neither is tighter. A tenant that exhausts its month recovers it
gradually (1/30 per day) instead of all at once at midnight of the 1st.

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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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


# (Limits field, window seconds, charged in requests rather than tokens)
_WINDOWS: tuple[tuple[str, float, bool], ...] = (
    ("requests_per_minute", MINUTE_S, True),
    ("requests_per_day", DAY_S, True),
    ("requests_per_month", MONTH_S, True),
    ("tokens_per_minute", MINUTE_S, False),
    ("tokens_per_day", DAY_S, False),
    ("tokens_per_month", MONTH_S, False),
)


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    rate: float  # refill per second
    level: float
    updated_s: float

    @classmethod
    def full(cls, limit: float, window_s: float, now: float) -> TokenBucket:
        return cls(capacity=float(limit), rate=limit / window_s, level=float(limit), updated_s=now)

    def refill(self, now: float) -> None:
        # A clock that steps backwards (it should not: callers pass a monotonic clock) must
        # not drain the bucket; time simply stands still until it catches up.
        if now > self.updated_s:
            self.level = min(self.capacity, self.level + (now - self.updated_s) * self.rate)
            self.updated_s = now

    def wait_s(self, amount: float, now: float) -> float | None:
        """Seconds until ``amount`` fits, 0 if it fits now, None if it never fits."""
        self.refill(now)
        if amount > self.capacity * (1 + _TOLERANCE):
            return None
        missing = amount - self.level
        if missing <= _TOLERANCE * max(1.0, amount):
            return 0.0
        return missing / self.rate

    def take(self, amount: float, now: float) -> None:
        """Charge unconditionally; the level may go negative (debt)."""
        self.refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """Return a charge; never above capacity, so refunds cannot bank a bigger burst."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def snapshot(self, now: float) -> dict[str, float]:
        self.refill(now)
        return {"level": self.level, "capacity": self.capacity, "rate_per_s": self.rate}


@dataclass(slots=True)
class _Scope:
    """The buckets of one scope: a tier, a tenant, or a tenant on one endpoint or model."""

    requests: list[tuple[str, TokenBucket]] = field(default_factory=list)
    tokens: list[tuple[str, TokenBucket]] = field(default_factory=list)

    @classmethod
    def from_limits(cls, limits: RateLimits, now: float, scale: float = 1.0) -> _Scope:
        scope = cls()
        for name, window_s, per_request in _WINDOWS:
            limit = getattr(limits, name)
            if limit is None:
                continue
            bucket = TokenBucket.full(limit * scale, window_s, now)
            (scope.requests if per_request else scope.tokens).append((name, bucket))
        return scope


@dataclass(frozen=True, slots=True)
class Admit:
    tokens: int  # the token estimate charged; pass it back to settle() or refund()


def _limits_anything(limits: RateLimits) -> bool:
    return any(getattr(limits, name) is not None for name, _, _ in _WINDOWS)


# A scope's identity: ("tier", tier), ("tenant", tenant), ("endpoint", tenant, endpoint) or
# ("model", tenant, model). The same key names a scope's buckets here and in a shared store.
ScopeKey = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket a request is charged to: its scope, its window, its size."""

    scope: ScopeKey
    name: str  # the Limits field, e.g. "tokens_per_minute"
    capacity: float
    rate: float  # refill per second
    per_request: bool  # charged one per request, rather than tokens


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

    def buckets(self, tenant: str, endpoint: str, tier: str | None,
                model: str | None) -> list[BucketSpec]:
        """Every bucket of every scope that applies, requests before tokens in each."""
        return [BucketSpec(key, name, float(limit), limit / window_s, per_request)
                for key, limits in self.scopes(tenant, endpoint, tier, model)
                for name, window_s, per_request in _WINDOWS
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
    limit (a replica's share of limits it cannot coordinate, sidecar.shared)."""

    def __init__(self, table: LimitTable, *, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError("scale must be positive")
        self.table = table
        self._scale = scale
        # Buckets are created on first use: 10,000 configured tenants cost nothing until
        # they send. A new bucket starts full, which is what a bucket created at startup
        # would have refilled to anyway.
        self._scopes_by_key: dict[ScopeKey, _Scope] = {}

    def _scopes(self, tenant: str, endpoint: str, now: float,
                tier: str | None, model: str | None) -> list[_Scope]:
        scopes = []
        for key, limits in self.table.scopes(tenant, endpoint, tier, model):
            scope = self._scopes_by_key.get(key)
            if scope is None:
                scope = self._scopes_by_key[key] = _Scope.from_limits(limits, now, self._scale)
            scopes.append(scope)
        return scopes

    def retable(self, table: LimitTable, now: float) -> None:
        """Take a new configuration's limits, keeping what was spent (module doc, "Reload")."""
        scopes: dict[ScopeKey, _Scope] = {}
        for key, old in self._scopes_by_key.items():
            limits = table.limits_for(key)
            if limits is None or not _limits_anything(limits):
                continue
            new = scopes[key] = _Scope.from_limits(limits, now, self._scale)
            spent = {}
            for name, bucket in (*old.requests, *old.tokens):
                bucket.refill(now)
                spent[name] = bucket.capacity - bucket.level
            for name, bucket in (*new.requests, *new.tokens):
                if name in spent:
                    bucket.level = bucket.capacity - spent[name]
        self.table = table
        self._scopes_by_key = scopes

    def admit(self, tenant: str, endpoint: str, tokens: int, now: float,
              tier: str | None = None, model: str | None = None) -> Admit | Reject:
        """Charge one request and ``tokens`` (the estimate) or say how long to wait."""
        scopes = self._scopes(tenant, endpoint, now, tier, model)
        wait = 0.0
        binding = ""
        for scope in scopes:
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
        for scope in scopes:
            for _, bucket in scope.requests:
                bucket.take(1, now)
            for _, bucket in scope.tokens:
                bucket.take(tokens, now)
        return Admit(tokens)

    def settle(self, tenant: str, endpoint: str, estimated: int, actual: int, now: float,
               tier: str | None = None, model: str | None = None) -> None:
        """Correct the token charge to the real count: extra charge (possibly into debt) when
        the estimate was low, a refund when it was high."""
        delta = actual - estimated
        if delta == 0:
            return
        for scope in self._scopes(tenant, endpoint, now, tier, model):
            for _, bucket in scope.tokens:
                if delta > 0:
                    bucket.take(delta, now)
                else:
                    bucket.give(-delta, now)

    def refund(self, tenant: str, endpoint: str, tokens: int, now: float,
               tier: str | None = None, model: str | None = None) -> None:
        """Give back the token charge of a request that produced nothing (see module doc)."""
        for scope in self._scopes(tenant, endpoint, now, tier, model):
            for _, bucket in scope.tokens:
                bucket.give(tokens, now)

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
