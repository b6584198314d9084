"""Weighted deficit round robin across the backlogged tenants (flows) of one tier.

The ring as a heap
------------------
Classic DRR walks a ring of backlogged flows; each visit adds the flow's quantum to its
credit and serves its head requests while the credit lasts. A flow whose request costs
several quanta (a long prompt, a small weight, or a debt from settlement) needs several
visits, and if every flow is in that state a ring walk spins through all of them adding
quanta without serving anyone: O(tenants) per decision.

Here each backlogged flow sits in a heap keyed ``(round, position)``: ``round`` is the round
of its next visit and ``position`` its place in the ring (a counter drawn every time it goes
to the tail). Popping the minimum visits flows in exactly the ring's order, and a flow that
cannot afford anything for ``k`` rounds is given ``k`` quanta at once and keyed ``k`` rounds
ahead, as the ring would after ``k`` fruitless visits. Every decision is O(log n), with no
walk over idle or indebted flows.

Credit and turns (the "serve while credit > 0" form, as Linux's fq/fq_codel)
-----------------------------------------------------------------------------
A flow keyed at round ``r`` has already been credited for ``r``. At its turn it is served
while its credit is positive, each request subtracting its full cost (so the credit may end
below zero, by less than one request's cost), then it goes to the tail with as many quanta
as it takes to be positive again. Credits are floats in whatever unit the caller uses;
``Scheduler`` uses *turns* (cost / endpoint quantum) so endpoints with different cost models
share one ring, and gives each tenant ``weight`` turns per round.

Turn size, apart from the quantum
---------------------------------
The quantum is what a flow may spend a round: its share. How much of it one visit spends is
the *turn* (``consume(..., turn=)``): a flow still in credit that has spent a turn's worth
in this visit goes to the tail of the *same* round, keeping its credit, and the flows keyed
for that round are visited before it again. So a streaming endpoint can rotate one request
a tenant while a batch endpoint serves a batch, with every share and price unchanged: a
same-round requeue moves neither round nor credit, and the bound below is untouched.
``Scheduler`` passes the tenant's weight times the endpoint's turn, so tenants interleave
in the ratio of their weights within a round: a backlog of a few requests (a closed loop's)
is then served at its share before it empties, instead of at one request a visit until the
lighter flows' credit runs out.

Settlement and live charging
----------------------------
``adjust(flow, delta)`` moves credit at any time: ``+`` for a real count above what was
charged (or tokens streamed beyond the estimate), ``-`` for a refund. A flow whose credit
an adjustment drives to zero or below is re-keyed lazily at its next visit.

Idle flows: surplus is dropped, debt is kept
--------------------------------------------
When a flow's queue empties, classic DRR resets its deficit to 0 so it cannot bank credit
while idle. We clamp the credit to ``min(credit, 0)`` instead: a positive surplus is dropped
(no banking), but a *debt* is kept. Requests are settled after dispatch, usually after their
tenant's queue has emptied; resetting debt on idle would let a tenant that sends one request
at a time never pay for output beyond its estimate. A kept debt costs nothing when no one
else is backlogged (rounds are skipped for free) and is paid in rounds skipped when there is
contention. Refunds to an idle flow cancel debt but never raise its credit above zero.

The guarantee (property-tested in tests/unit/sidecar/test_drr_properties.py)
-----------------------------------------------------------------------------
Let flow ``i`` have quantum ``q_i = w_i`` (turns per round, weight-normalised unit: one
quantum) and let ``C_i`` bound the cost of any request it is served. Let ``x_i`` be its
*booked* service divided by ``w_i``: costs charged at dispatch plus every adjustment. Define
``V_i = round_i - credit_i / w_i``; ``x_i - V_i`` is constant while ``i`` stays backlogged (a
quantum moves both terms equally; service and adjustments move both). If ``R`` is the round
being served, every backlogged flow satisfies ``R - 1 - P_i/w_i <= V_i < R + (C_i + D_i)/w_i``
where ``P_i`` / ``D_i`` are refunds / extra charges it received since its last turn (or debt it
carried when it became backlogged); without adjustments ``R - 1 <= V_i < R + C_i/w_i``. Hence
for two flows continuously backlogged over an interval, the weight-normalised service
difference satisfies

* from an instant where ``V_i = V_j`` (e.g. both became backlogged in the same round from
  idle, without debt):   ``|dx_i - dx_j| < 1 + max(C_i/w_i, C_j/w_j)``  (one quantum plus one
  weight-normalised maximal request: in tokens, ``Q + C/w``);
* over any sub-interval:  ``|dx_i - dx_j| < 2 + C_i/w_i + C_j/w_j`` (classic DRR's
  ``2Q + Max``), plus ``2 A_i/w_i + 2 A_j/w_j`` with adjustments, where ``A_i`` bounds the
  sum of ``|adjustments|`` flow ``i`` receives in its current backlog period plus the debt
  it carried into it (``P_i, D_i <= A_i``). Settlement therefore keeps the classic bound up
  to the estimation error it corrects.

Eligibility (``pick(eligible=...)``) lets the caller skip flows that may not use the
capacity at hand (admission headroom). A skipped flow keeps its key and gains no quanta for
the rounds it was skipped: it is not compensated for capacity it was not allowed to use.
Those quanta are counted (``forfeited``): a flow served at round ``R`` after being keyed for
``r < R`` forfeits ``(R - r) * q`` credit, and the bound above holds for it with its
weight-normalised forfeit added (what a caller checking fairness adds to its margin).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Flow:
    quantum: float
    credit: float = 0.0
    round: int = 0
    position: int = 0
    version: int = 0  # a heap entry is live only while its version matches
    active: bool = False
    forfeited: float = 0.0  # credit not granted for rounds it was passed over (ineligible)
    visit: float = 0.0  # spent in the current visit, against the turn


# (round, position, version, flow): positions are unique, so names are never compared.
_Entry = tuple[int, int, int, str]


class DeficitRoundRobin:
    def __init__(self) -> None:
        self._flows: dict[str, _Flow] = {}
        self._heap: list[_Entry] = []
        self._next_position = 0
        self._round = 0
        self._active = 0

    # ------------------------------------------------------------------ flows

    def add(self, flow: str, quantum: float) -> None:
        """Register a flow (or change its quantum, effective from its next round)."""
        if not quantum > 0 or math.isinf(quantum):
            raise ValueError(f"quantum must be positive and finite, got {quantum}")
        existing = self._flows.get(flow)
        if existing is None:
            self._flows[flow] = _Flow(quantum)
        else:
            existing.quantum = quantum

    def __contains__(self, flow: object) -> bool:
        return flow in self._flows

    @property
    def active_count(self) -> int:
        return self._active

    @property
    def round(self) -> int:
        """The round being served (advances as the ring wraps)."""
        return self._round

    def credit(self, flow: str) -> float:
        return self._flows[flow].credit

    def forfeited(self, flow: str) -> float:
        """Credit the flow did not receive for rounds in which it was passed over as
        ineligible while others were served (cumulative, in the caller's unit), including
        the rounds of a pass-over still going on, so that a window ending mid-pass-over
        counts it (the count never decreases)."""
        f = self._flows[flow]
        pending = (self._round - f.round) * f.quantum if f.active and f.round < self._round else 0
        return f.forfeited + pending

    def key(self, flow: str) -> tuple[int, int] | None:
        """(round, position) of an active flow's next visit: its place in the ring."""
        f = self._flows[flow]
        return (f.round, f.position) if f.active else None

    def activate(self, flow: str) -> None:
        """The flow became backlogged: it joins at the tail of the ring."""
        f = self._flows[flow]
        if f.active:
            raise ValueError(f"flow {flow!r} is already active")
        f.active = True
        self._active += 1
        # Tail of the ring: after every flow already visited in the current round, i.e.
        # keyed for the next round with a fresh position. (Keying it in the current round
        # would let a flow that empties and refills at once be served again before the
        # others' next turn.)
        self._requeue(f, flow, self._round)
        self._maybe_compact()

    def deactivate(self, flow: str) -> None:
        """The flow's queue emptied (served or cancelled): it leaves the ring."""
        f = self._flows[flow]
        if not f.active:
            raise ValueError(f"flow {flow!r} is not active")
        self._forfeit(f, f.round)  # a pass-over it leaves during is lost all the same
        f.active = False
        f.visit = 0.0
        f.version += 1  # its heap entry is now dead
        self._active -= 1
        f.credit = min(f.credit, 0.0)  # drop surplus, keep debt (module doc)
        self._maybe_compact()

    # ------------------------------------------------------------------ decisions

    def _forfeit(self, f: _Flow, keyed_round: int) -> None:
        # Keyed for an earlier round than the one being served: only a pass-over (pick's
        # eligibility) lets the ring move past a live flow, and the rounds it moved are lost.
        if keyed_round < self._round:
            f.forfeited += (self._round - keyed_round) * f.quantum

    def _requeue(self, f: _Flow, flow: str, base_round: int) -> None:
        """Send a flow whose credit is <= 0 to the tail, credited for as many rounds after
        ``base_round`` as it needs to be positive again."""
        f.visit = 0.0
        rounds = math.floor(-f.credit / f.quantum) + 1
        f.credit += rounds * f.quantum
        while f.credit <= 0:  # float rounding in the division above
            f.credit += f.quantum
            rounds += 1
        f.round = base_round + rounds
        f.position = self._next_position
        self._next_position += 1
        f.version += 1
        heapq.heappush(self._heap, (f.round, f.position, f.version, flow))

    def pick(self, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The flow whose turn it is (positive credit, first in ring order), or None.

        Does not charge anything: call ``consume`` with the cost of the request actually
        served. Flows for which ``eligible`` is false are passed over without losing their
        place.
        """
        heap = self._heap
        passed_over: list[_Entry] = []
        chosen = None
        while heap:
            round_, _, version, flow = heap[0]
            f = self._flows[flow]
            if not f.active or f.version != version:
                heapq.heappop(heap)  # dead: deactivated or re-keyed since pushed
                continue
            if f.credit <= 0:
                # Charged by settlement or streaming since it was keyed: this visit passes
                # it by, exactly as a ring visit without enough credit would.
                heapq.heappop(heap)
                self._round = max(self._round, round_)
                self._forfeit(f, round_)
                self._requeue(f, flow, self._round)
                continue
            if eligible is not None and not eligible(flow):
                passed_over.append(heapq.heappop(heap))
                continue
            self._round = max(self._round, round_)
            chosen = flow
            break
        for entry in passed_over:
            heapq.heappush(heap, entry)
        return chosen

    def consume(self, flow: str, cost: float, backlogged: bool,
                turn: float = math.inf) -> None:
        """Charge the request just served from ``flow`` (the one ``pick`` returned);
        ``backlogged`` says whether the flow still has queued requests; ``turn``: what one
        visit may spend before the next flow's (module doc, "Turn size")."""
        if not cost > 0:
            raise ValueError(f"cost must be positive, got {cost}")
        f = self._flows[flow]
        if not f.active:
            raise ValueError(f"flow {flow!r} is not active")
        f.credit -= cost
        f.visit += cost
        if not backlogged:
            self.deactivate(flow)
        elif f.credit <= 0:
            # End of its round's credit. Base on the current round, not the flow's own: a
            # flow that was passed over (ineligible) is not compensated for the rounds it
            # missed.
            self._forfeit(f, f.round)
            self._requeue(f, flow, max(f.round, self._round))
            self._maybe_compact()
        elif f.visit >= turn:
            # A turn spent with credit left: the tail of the round it is served in, its
            # credit kept for its next visit.
            self._forfeit(f, f.round)
            f.round = max(f.round, self._round)
            f.visit = 0.0
            f.position = self._next_position
            self._next_position += 1
            f.version += 1
            heapq.heappush(self._heap, (f.round, f.position, f.version, flow))
            self._maybe_compact()

    def adjust(self, flow: str, delta: float) -> None:
        """Charge ``delta`` more (settlement above the charge, streamed tokens) or, negative,
        refund it. Applies to idle flows too, which can go into debt but not into surplus."""
        f = self._flows[flow]
        f.credit -= delta
        if not f.active:
            f.credit = min(f.credit, 0.0)

    def settle(self, flow: str, charged: float, actual: float) -> None:
        """The real cost of a served request is known: correct what was charged."""
        self.adjust(flow, actual - charged)

    def _maybe_compact(self) -> None:
        # Dead entries leave from the top, but one per re-key or idle transition of a
        # flow deep in the heap can pile up; rebuild when they outnumber the live ones.
        if len(self._heap) > 2 * self._active + 64:
            self._heap = [
                (f.round, f.position, f.version, name)
                for name, f in self._flows.items()
                if f.active
            ]
            heapq.heapify(self._heap)

    def snapshot(self) -> dict[str, Any]:
        return {
            "round": self._round,
            "active": self._active,
            "flows": {
                name: {
                    "credit": f.credit,
                    "quantum": f.quantum,
                    "next_round": f.round if f.active else None,
                    "active": f.active,
                }
                for name, f in self._flows.items()
                if f.active or f.credit != 0
            },
        }
