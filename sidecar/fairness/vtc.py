"""The virtual token counter (VTC, Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024) as a fairness policy.

Each tenant of a tier has a counter of the service it received, weight-normalised: serving
it a request adds the request's cost over its weight (the cost ``drr`` charges: computed
prompt plus output tokens, over the endpoint's quantum; streamed output past the estimate
and the settlement at the end move it too). The backlogged tenant with the lowest counter
goes next. A tenant that becomes backlogged is *lifted* to the lowest counter of the
backlogged ones (or, with none, to where the last one left off), so time spent idle earns no
credit. A backlogged tenant passed over because it may not use the capacity at hand (the
caller's ``eligible``) is lifted to the chosen one's counter: it is not compensated later
for what it could not use, and the lift is counted as ``forfeited``.

Bound: among backlogged tenants the counters stay within one maximal request's cost over
its weight of each other (the one served was the lowest, and one request moves it by at most
that), so two continuously backlogged tenants' weight-normalised service, forfeits counted,
differs by at most twice that plus their adjustments (tests/unit/sidecar/
test_fairness_conformance.py checks the bound every policy states, DRR's and this one).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weighbridge.sidecar.plugins import register


@dataclass(slots=True)
class _Flow:
    weight: float
    counter: float = 0.0  # service received over weight, in the policy's unit
    active: bool = False
    version: int = 0  # a heap entry is live only while its version matches
    forfeited: float = 0.0  # service not received while passed over (ineligible)


# (counter, order, version, flow): orders are unique, so names are never compared.
_Entry = tuple[float, int, int, str]


@register("fairness", "vtc")
class VirtualTokenCounter:
    """Virtual token counter (VTC): the backlogged tenant of a tier that has received the
    least service, weighted, goes next; service is counted in the same tokens ``drr``
    charges (computed prompt plus output, over the endpoint's quantum), and a tenant
    returning from idle is lifted to the others' counters so idle time earns no credit.
    Tiers are served strictly by rank."""

    holds_requests = True
    per_tenant = True
    weighted = True
    costs_tokens = True

    def __init__(self) -> None:
        self._flows: dict[str, _Flow] = {}
        self._heap: list[_Entry] = []
        self._order = itertools.count()
        self._active = 0
        self._left_at = 0.0  # the counter of the last flow to leave an empty tier
        self._decisions = 0

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        return cost / quantum

    @property
    def round(self) -> int:
        """Decisions made (VTC keeps no rounds)."""
        return self._decisions

    def __contains__(self, flow: object) -> bool:
        return flow in self._flows

    def add(self, flow: str, weight: float) -> None:
        """Register a flow, or change its weight (for the service it receives from now)."""
        if not 0 < weight < math.inf:
            raise ValueError(f"weight must be positive and finite, got {weight}")
        self._flows.setdefault(flow, _Flow(weight)).weight = weight

    def activate(self, flow: str) -> None:
        f = self._flows[flow]
        if f.active:
            raise ValueError(f"flow {flow!r} is already active")
        f.counter = max(f.counter, self._virtual_time())
        f.active = True
        self._active += 1
        self._push(f, flow)

    def deactivate(self, flow: str) -> None:
        f = self._flows[flow]
        if not f.active:
            raise ValueError(f"flow {flow!r} is not active")
        f.active = False
        f.version += 1
        self._active -= 1
        if not self._active:
            self._left_at = max(self._left_at, f.counter)
        self._maybe_compact()

    def pick(self, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The active flow with the lowest counter that ``eligible`` allows; those passed
        over are lifted to its counter (the lift counted as forfeited)."""
        heap = self._heap
        passed_over: list[str] = []
        chosen: str | None = None
        while heap:
            _, _, version, name = heap[0]
            f = self._flows[name]
            if not f.active or f.version != version:
                heapq.heappop(heap)
                continue
            if eligible is not None and not eligible(name):
                heapq.heappop(heap)
                passed_over.append(name)
                continue
            chosen = name
            break
        if chosen is not None:
            self._decisions += 1
            level = self._flows[chosen].counter
            for name in passed_over:
                f = self._flows[name]
                if f.counter < level:
                    f.forfeited += (level - f.counter) * f.weight
                    f.counter = level
        for name in passed_over:
            self._push(self._flows[name], name)
        return chosen

    def consume(self, flow: str, cost: float, backlogged: bool,
                turn: float = math.inf) -> None:
        del turn  # the least-served flow is chosen at every decision: a turn of one request
        if not cost > 0:
            raise ValueError(f"cost must be positive, got {cost}")
        f = self._flows[flow]
        if not f.active:
            raise ValueError(f"flow {flow!r} is not active")
        f.counter += cost / f.weight
        if backlogged:
            self._push(f, flow)
        else:
            self.deactivate(flow)

    def adjust(self, flow: str, delta: float) -> None:
        """Service ``delta`` more (a settlement above the charge, streamed tokens) or,
        negative, refunded; an idle flow's refund is undone by its lift when it returns."""
        f = self._flows[flow]
        f.counter += delta / f.weight
        if f.active:
            self._push(f, flow)

    def credit(self, flow: str) -> float:
        """Service the flow is owed against the tier's lowest backlogged counter (0 at the
        front; negative: ahead of it), in the policy's unit."""
        f = self._flows[flow]
        return (self._virtual_time() - f.counter) * f.weight

    def forfeited(self, flow: str) -> float:
        return self._flows[flow].forfeited

    def snapshot(self) -> dict[str, Any]:
        return {
            "decisions": self._decisions,
            "active": self._active,
            "flows": {name: {"counter": f.counter, "weight": f.weight, "active": f.active}
                      for name, f in self._flows.items()},
        }

    def _virtual_time(self) -> float:
        """The lowest counter among the active flows; with none, where the last one left."""
        heap = self._heap
        while heap:
            counter, _, version, name = heap[0]
            f = self._flows[name]
            if f.active and f.version == version:
                return counter
            heapq.heappop(heap)  # dead: deactivated or re-keyed since pushed
        return self._left_at

    def _push(self, f: _Flow, name: str) -> None:
        f.version += 1
        heapq.heappush(self._heap, (f.counter, next(self._order), f.version, name))
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        # Dead entries leave from the top; rebuild when they outnumber the live ones.
        if len(self._heap) > 2 * self._active + 64:
            self._heap = [entry for entry in self._heap
                          if (f := self._flows[entry[3]]).active and f.version == entry[2]]
            heapq.heapify(self._heap)
