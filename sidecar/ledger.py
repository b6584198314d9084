"""Every request ends exactly once: the counters behind the arrivals = ends + in-flight check.

Counted per (tenant, tier), and again per model (the model a request was served as: its
``model``, or the fleet's default); totals and per-tenant / per-tier views are sums. At every moment
``arrivals == completed + rejected + cancelled + failed + queued + dispatched`` holds for each
tally (``Tally.balanced``); ending a request that is not in flight raises ``LedgerError``, so
a double end is a loud bug rather than a silent miscount.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class Outcome(Enum):
    COMPLETED = "completed"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    FAILED = "failed"


class LedgerError(RuntimeError):
    pass


@dataclass(slots=True)
class Tally:
    arrivals: int = 0
    completed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # by reason
    cancelled: int = 0
    failed: int = 0
    queued: int = 0
    dispatched: int = 0

    @property
    def in_flight(self) -> int:
        return self.queued + self.dispatched

    @property
    def ended(self) -> int:
        return self.completed + sum(self.rejected.values()) + self.cancelled + self.failed

    @property
    def balanced(self) -> bool:
        return self.arrivals == self.ended + self.in_flight

    def add(self, other: Tally) -> None:
        self.arrivals += other.arrivals
        self.completed += other.completed
        self.rejected.update(other.rejected)
        self.cancelled += other.cancelled
        self.failed += other.failed
        self.queued += other.queued
        self.dispatched += other.dispatched

    def as_dict(self) -> dict[str, Any]:
        return {
            "arrivals": self.arrivals,
            "completed": self.completed,
            "rejected": dict(self.rejected),
            "cancelled": self.cancelled,
            "failed": self.failed,
            "queued": self.queued,
            "dispatched": self.dispatched,
        }


@dataclass(slots=True)
class _Open:
    tally: Tally  # its (tenant, tier)'s
    model_tally: Tally  # its model's
    dispatched: bool = False


class Ledger:
    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str], Tally] = {}
        self._models: dict[str, Tally] = {}
        self._open: dict[str, _Open] = {}

    def _tally(self, tenant: str, tier: str) -> Tally:
        tally = self._tallies.get((tenant, tier))
        if tally is None:
            tally = self._tallies[(tenant, tier)] = Tally()
        return tally

    def _get(self, request_id: str) -> _Open:
        entry = self._open.get(request_id)
        if entry is None:
            raise LedgerError(f"request {request_id!r} is not in flight "
                              "(it already ended, or never arrived)")
        return entry

    # ------------------------------------------------------------------ transitions

    def arrive(self, request_id: str, tenant: str, tier: str, model: str = "") -> None:
        """A request was accepted for checking; it is in flight (queued) until it ends.
        ``model``: the model it is served as ("" when unknown or not served)."""
        if request_id in self._open:
            raise LedgerError(f"request {request_id!r} arrived twice")
        model_tally = self._models.get(model)
        if model_tally is None:
            model_tally = self._models[model] = Tally()
        entry = self._open[request_id] = _Open(self._tally(tenant, tier), model_tally)
        for tally in (entry.tally, entry.model_tally):
            tally.arrivals += 1
            tally.queued += 1

    def rejected_on_arrival(self, tenant: str, tier: str, reason: str) -> None:
        """An arrival turned away before it got an identity (unauthorized, malformed)."""
        tally = self._tally(tenant, tier)
        tally.arrivals += 1
        tally.rejected[reason] += 1

    def dispatch(self, request_id: str) -> None:
        entry = self._get(request_id)
        if entry.dispatched:
            raise LedgerError(f"request {request_id!r} dispatched twice")
        entry.dispatched = True
        for tally in (entry.tally, entry.model_tally):
            tally.queued -= 1
            tally.dispatched += 1

    def requeue(self, request_id: str) -> None:
        entry = self._get(request_id)
        if not entry.dispatched:
            raise LedgerError(f"request {request_id!r} is not dispatched")
        entry.dispatched = False
        for tally in (entry.tally, entry.model_tally):
            tally.dispatched -= 1
            tally.queued += 1

    def end(self, request_id: str, outcome: Outcome, reason: str = "") -> None:
        entry = self._get(request_id)
        del self._open[request_id]
        for tally in (entry.tally, entry.model_tally):
            if entry.dispatched:
                tally.dispatched -= 1
            else:
                tally.queued -= 1
            if outcome is Outcome.COMPLETED:
                tally.completed += 1
            elif outcome is Outcome.REJECTED:
                tally.rejected[reason or "unspecified"] += 1
            elif outcome is Outcome.CANCELLED:
                tally.cancelled += 1
            else:
                tally.failed += 1

    # ------------------------------------------------------------------ views

    def tallies(self) -> dict[tuple[str, str], Tally]:
        """Per (tenant, tier); the live objects (read them, do not modify them)."""
        return self._tallies

    def by_model(self) -> dict[str, Tally]:
        """Per model, of the requests that arrived with an identity (copies); a model's
        tallies add up to the same totals as the (tenant, tier) ones, less the arrivals
        rejected before they had one (``rejected_on_arrival``)."""
        return {model: replace(tally, rejected=Counter(tally.rejected))
                for model, tally in self._models.items()}

    def total(self) -> Tally:
        total = Tally()
        for tally in self._tallies.values():
            total.add(tally)
        return total

    def by_tenant(self) -> dict[str, Tally]:
        out: dict[str, Tally] = {}
        for (tenant, _), tally in self._tallies.items():
            out.setdefault(tenant, Tally()).add(tally)
        return out

    def by_tier(self) -> dict[str, Tally]:
        out: dict[str, Tally] = {}
        for (_, tier), tally in self._tallies.items():
            out.setdefault(tier, Tally()).add(tally)
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            "total": self.total().as_dict(),
            "by_tenant_tier": {
                f"{tenant}/{tier}": tally.as_dict()
                for (tenant, tier), tally in self._tallies.items()
            },
            "by_model": {model: tally.as_dict() for model, tally in self._models.items()},
        }
