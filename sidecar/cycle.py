"""One dispatch decision, in the order the code runs it: the backends' standings, the tenants
eligible on them, the fairness policy's pick among those tenants, then the scored backends.

1. **Standings.** Every healthy backend of the pool: its admission gate's verdict (open,
   headroom or closed, from the engine's own metrics), refined by the backend rules
   (``sidecar.eligibility.BACKEND_RULES``).
2. **Eligible tenants.** On the open backends, the tenants the open rules let in; failing a
   dispatch there, on the backends in headroom, those the headroom rules let in (the
   tenant-aware policies only: the FIFO baselines take headroom as ordinary capacity).
3. **Fairness.** The pool's scheduler picks the next request among the tenants eligible on
   at least one of those backends (``Scheduler.next``: tier, then the fairness policy, then
   the tenant's own order), and the backends its tenant may use go on with it. A tenant
   held on one backend is still eligible on another, so no open backend idles while a
   tenant it would take waits (work conservation).
4. **Scored backends.** The route (``sidecar.routing``) picks among those backends by its
   scorers; when an affinity scorer has something to say of the request, the backends in
   headroom whose rules let its tenant in, and those held back for prefill alone whose
   cache pays for it (``cache_pays_prefill``), are weighed with them.

Nothing dispatchable: every closed gate's hold is counted (``holds``). ``SchedulingCore``
keeps the request's lifecycle around a decision (``Decision``): its charges, tickets and
the body's priority. Pools take turns (``DispatchCycle.next``), so one pool's backlog never
delays another's dispatch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weighbridge.sidecar.eligibility import (
    HEADROOM_RULES,
    OPEN_RULES,
    BackendState,
    Pass,
    Standing,
    TenantRule,
    cache_pays_prefill,
    eligible,
    kv_fit,
    refine,
)
from weighbridge.sidecar.predictor import ThroughputMeter, WaitPredictor
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import Scheduler

if TYPE_CHECKING:
    from weighbridge.sidecar.config import Tenant
    from weighbridge.sidecar.fleet import Fleet
    from weighbridge.sidecar.routing import Route

__all__ = ["LIGHT_MEMORY_S", "Decision", "DispatchCycle", "Pool", "light_tenants",
           "share_slots"]

# How long a light tenant keeps the derived headroom reserved after its last dispatch: it
# covers the gaps of a tenant sending a few requests a second, and lets the headroom go back
# to backlogged tenants soon after the last light one stopped.
LIGHT_MEMORY_S = 10.0


@dataclass(slots=True)
class Pool:
    """The backends serving one set of models, and the queues waiting for them: admission
    and fairness are judged per pool (shares are of the pool's slots, DRR is the pool's)."""

    backends: frozenset[str]
    scheduler: Scheduler
    meter: ThroughputMeter
    predictor: WaitPredictor
    # Tenant -> when it last arrived to an empty queue of its own or dispatched leaving
    # it empty; dropped when it dispatches with more queued (backlogged upstream). For
    # the derived, work-conserving headroom (GateLimits.headroom_always).
    light: dict[str, float]
    # Other replicas' load on these backends, by tenant: (in flight, backlogged somewhere),
    # set by sidecar.replica; empty when this process runs alone.
    foreign: dict[str, tuple[int, bool]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """A request the pool's scheduler has counted in flight, and where it goes."""

    pool: Pool
    request: QueuedRequest
    backend: str
    slots: int  # the pool's share slots at the decision: what its share is judged on


def light_tenants(pool: Pool, now: float) -> set[str]:
    """Tenants not backlogged upstream lately: the well-behaved the headroom is for."""
    light = pool.light
    for tenant in [t for t, at in light.items() if now - at > LIGHT_MEMORY_S]:
        del light[tenant]
    return set(light)


def share_slots(fleet: Fleet, now: float, backends: frozenset[str] | None) -> int:
    """In-flight slots that weighted shares are computed over: the healthy backends' caps
    without their headroom (of ``backends``; None: all)."""
    return sum(
        b.gate.share_slots(now)
        for b in fleet
        if b.takes_work and (backends is None or b.name in backends)
    )


class DispatchCycle:
    def __init__(self, fleet: Fleet, route: Route, tenants: Mapping[str, Tenant]) -> None:
        self.fleet = fleet
        self.route = route
        self.tenants = tenants  # the configuration's, for the replicas' global share
        # Dispatch attempts held, by (backend, reason); backend "" for no backend at all.
        self.holds: Counter[tuple[str, str]] = Counter()
        # The route's choices where affinity was weighed, by (backend, reason): affinity,
        # load, bounded.
        self.routing_decisions: Counter[tuple[str, str]] = Counter()
        self._next_pool = 0  # pools take turns at the dispatch decision

    def next(self, pools: list[Pool], now: float) -> Decision | None:
        """One decision among ``pools`` (those with requests queued), taking turns."""
        if len(pools) == 1:
            return self.next_in_pool(pools[0], now)
        start = self._next_pool % len(pools)
        for i in range(len(pools)):
            decision = self.next_in_pool(pools[(start + i) % len(pools)], now)
            if decision is not None:
                self._next_pool = start + i + 1
                return decision
        return None

    def next_in_pool(self, pool: Pool, now: float) -> Decision | None:
        """The pool's next decision: the standings, then an open backend for anyone the open
        rules allow, then a backend in headroom for anyone the headroom rules allow; else
        every closed gate's hold."""
        if not pool.scheduler.holds_requests:
            return self._passthrough(pool, now)
        standings = self._standings(pool, now)
        if not standings:
            self.holds[("", "no_healthy_backend")] += 1
            return None
        slots = sum(s.verdict.share_slots for s in standings.values())
        tenant_aware = pool.scheduler.uses_headroom
        fair = self._globally_fair(pool, slots) if tenant_aware else None
        decision = self._next_open(pool, standings, slots, fair, now)
        if decision is None and tenant_aware:
            decision = self._next_in_headroom(pool, standings, slots, fair, now)
        if decision is None:
            for name, standing in standings.items():
                if standing.verdict.mode != "open":
                    self.holds[(name, standing.verdict.reason)] += 1
                    self.fleet[name].gate.holds[standing.verdict.reason] += 1
        return decision

    def _passthrough(self, pool: Pool, now: float) -> Decision | None:
        """No gate: the next request to any healthy backend."""
        fleet = self.fleet
        candidates = [b for b in fleet if b.takes_work and b.name in pool.backends]
        if not candidates:
            self.holds[("", "no_healthy_backend")] += 1
            return None
        request = pool.scheduler.next(now)
        assert request is not None
        backend = self.route.pick(request, candidates, fleet)
        return Decision(pool, request, backend.name, share_slots(fleet, now, pool.backends))

    def _standings(self, pool: Pool, now: float) -> dict[str, Standing]:
        """Every healthy backend of the pool, its gate's verdict refined by the backend
        rules."""
        tenant_aware = pool.scheduler.uses_headroom
        standings: dict[str, Standing] = {}
        for b in self.fleet:
            if b.name not in pool.backends or not b.takes_work:
                continue
            gate, footprint = b.gate, b.kv
            footprint.set_block_size(gate.limits.block_size)
            state = BackendState(gate, b.prefill_tokens, footprint, tenant_aware)
            standings[b.name] = refine(gate.verdict(now), b.name, state)
        return standings

    def _next_open(self, pool: Pool, standings: dict[str, Standing], slots: int,
                   fair: Callable[[str], bool] | None, now: float) -> Decision | None:
        # The FIFO baselines cannot choose an under-share tenant: headroom is ordinary
        # capacity for them.
        usable = ("open",) if pool.scheduler.uses_headroom else ("open", "headroom")
        names = [name for name, s in standings.items() if s.verdict.mode in usable]
        if not names:
            return None
        chosen = self._next_at(pool, names, OPEN_RULES, standings, slots, fair, now)
        if chosen is None:
            self.holds[("", "prefill_budget" if fair is None else "global_share")] += 1
            return None
        request, allowed = chosen
        backend = self._pick(request, allowed)
        if self.route.affine(request):
            # A backend in headroom whose rules let the tenant in may hold what the request
            # is affine to: the headroom pass would send it there, so affinity may too (a
            # flooded victim's session otherwise left its cache whenever its backend was at
            # the prefill backlog).
            headroom = [name for name, s in standings.items()
                        if s.verdict.mode == "headroom"] if pool.scheduler.uses_headroom else []
            if headroom:
                verdicts = self._verdicts(pool, headroom, HEADROOM_RULES, standings, slots,
                                          fair, now)
                allowed = allowed | {name for name, let_in in verdicts.items()
                                     if let_in is None or let_in(request.tenant)}
            backend = self._affine(request, backend, allowed, standings, fair, now)
        return Decision(pool, request, backend, slots)

    def _next_in_headroom(self, pool: Pool, standings: dict[str, Standing], slots: int,
                          fair: Callable[[str], bool] | None, now: float) -> Decision | None:
        # The global share binds in headroom too: work-conserving headroom with no light
        # tenant around is ordinary capacity, and without the rule a replica serving a
        # tenant over its share across replicas took it all (3 replicas, 8 slots: the
        # tenant sending through one replica got 0.60-0.66 of the engine).
        names = [name for name, s in standings.items() if s.verdict.mode == "headroom"]
        if not names:
            return None
        chosen = self._next_at(pool, names, HEADROOM_RULES, standings, slots, fair, now)
        if chosen is None:
            return None
        request, allowed = chosen
        backend = self._pick(request, allowed)
        if self.route.affine(request):
            backend = self._affine(request, backend, allowed, standings, fair, now)
        return Decision(pool, request, backend, slots)

    def _next_at(self, pool: Pool, names: list[str], rules: tuple[TenantRule, ...],
                 standings: dict[str, Standing], slots: int,
                 fair: Callable[[str], bool] | None, now: float,
                 ) -> tuple[QueuedRequest, frozenset[str]] | None:
        """Work conservation: the scheduler's next request among the tenants ``rules`` let
        in on at least one of the backends ``names``, and those of them its tenant may use.
        A tenant rule judges the tenant on one backend, so a tenant held on one is still
        eligible on another: choosing the backend before the request would leave an open
        backend idle while another backend's rule held the one tenant with work. At a KV
        watermark a held tenant's request that fits there may go (``kv_fit``)."""
        fits: dict[str, Callable[[QueuedRequest], bool]] = {}
        verdicts = self._verdicts(pool, names, rules, standings, slots, fair, now, fits)
        # Where each tenant the scheduler asks about may go, judged before its choice
        # counts the chosen request in flight (which the share rules read).
        where: dict[str, frozenset[str]] = {}

        def backends_for(tenant: str) -> frozenset[str]:
            found = where.get(tenant)
            if found is None:
                found = where[tenant] = frozenset(
                    name for name, allowed in verdicts.items()
                    if allowed is None or allowed(tenant))
            return found

        # Where each request asked about fits, judged as ``where`` is.
        fitting: dict[str, frozenset[str]] = {}
        passes = None
        if fits:
            def passes(request: QueuedRequest) -> bool:
                found = fitting[request.id] = frozenset(
                    name for name, fit in fits.items() if fit(request))
                return bool(found)

        request = pool.scheduler.next(now, lambda tenant: bool(backends_for(tenant)), passes)
        if request is None:
            return None
        return request, backends_for(request.tenant) or fitting[request.id]

    def _verdicts(self, pool: Pool, names: list[str], rules: tuple[TenantRule, ...],
                  standings: dict[str, Standing], slots: int,
                  fair: Callable[[str], bool] | None, now: float,
                  fits: dict[str, Callable[[QueuedRequest], bool]] | None = None,
                  ) -> dict[str, Callable[[str], bool] | None]:
        """Each of the backends ``names``: which tenants ``rules`` let in there (None:
        anyone); and into ``fits``, those at their KV watermark's ``kv_fit``."""
        light: frozenset[str] | None = None
        verdicts: dict[str, Callable[[str], bool] | None] = {}
        for name in names:
            standing, record = standings[name], self.fleet[name]
            limits = record.gate.limits
            # The light tenants are read (and the stale ones forgotten) once, and only where
            # a rule needs them.
            reason = standing.verdict.reason
            if light is None and (standing.kv_tight or reason == "prefill_backlog"
                                  or (reason == "headroom" and not limits.headroom_always)):
                light = frozenset(light_tenants(pool, now))
            p = Pass(
                standing, pool.scheduler, slots, record.kv,
                limits.max_prefill_tokens_inflight, record.prefilling,
                light or frozenset(), limits.headroom_always, limits.kv_watermark or 0, fair)
            verdicts[name] = eligible(rules, p)
            if fits is not None and (fit := kv_fit(rules, p)):
                fits[name] = fit
        return verdicts

    def _pick(self, request: QueuedRequest, allowed: frozenset[str]) -> str:
        """The route's pick for the chosen request among the backends its tenant may use
        (by the scorers that weigh load)."""
        fleet = self.fleet
        candidates = [b for b in fleet if b.takes_work and b.name in allowed]
        return self.route.pick(request, candidates, fleet).name

    def _affine(self, request: QueuedRequest, chosen: str, allowed: frozenset[str],
                standings: dict[str, Standing], fair: Callable[[str], bool] | None,
                now: float) -> str:
        """The backend the route's affinity prefers, among those whose rules let the
        request's tenant in (``allowed``) and those held back for prefill alone where the
        prefill their cache saves pays for it (``_prefill_paid``): passed over while it
        prefilled another prompt, a prefix's holder lost a request that recomputed the
        prefix elsewhere."""
        fleet, route = self.fleet, self.route
        held = {name: route.held(request, fleet[name]) for name in allowed}
        best_open = max(h for h, _ in held.values())
        for name, standing in standings.items():
            if name in allowed:
                continue
            holds = route.held(request, fleet[name])
            if holds[0] > best_open and self._prefill_paid(request, name, standing, fair,
                                                           holds[0], best_open, now):
                held[name] = holds
        backend, reason = route.weigh(request, chosen, held, fleet)
        self.routing_decisions[(backend, reason)] += 1
        return backend

    def _prefill_paid(self, request: QueuedRequest, backend: str, standing: Standing,
                      fair: Callable[[str], bool] | None, held: int, best_open: int,
                      now: float) -> bool:
        """Whether ``backend``, which holds ``held`` tokens of the prompt (more than the
        best backend offered, ``best_open``) but whose rules hold the request's tenant back,
        holds it back for prefill alone (its prefill backlog, the tenant's pacing) and the
        prefill its cache saves pays for what the request adds past those limits
        (``cache_pays_prefill``)."""
        record = self.fleet[backend]
        verdict, limits = standing.verdict, record.gate.limits
        computed, saved = request.prompt_tokens - held, held - best_open
        if verdict.reason == "prefill_backlog":
            # The backlog alone: the gate itself is open (slots, step budget, metrics).
            if record.gate.verdict(now).mode != "open" or not cache_pays_prefill(
                    record.prefill_tokens, limits.max_backend_prefill_tokens,
                    computed, saved):
                return False
        elif verdict.mode != "open":
            return False
        tenant = request.tenant
        mine = record.prefilling.get(tenant, 0)
        return (cache_pays_prefill(mine, limits.max_prefill_tokens_inflight, computed, saved)
                and (fair is None or fair(tenant)))

    def _globally_fair(self, pool: Pool, slots: int) -> Callable[[str], bool] | None:
        """With replicas sharing the backends (the pool's ``foreign`` load, set by
        sidecar.replica): a tenant holding at least its weighted share of the pool's slots
        across every replica waits while a tenant of its tier, backlogged on another replica
        or queued on this one, holds less than its own share.
        The slot it leaves goes to that replica's next dispatch: without this, each replica
        takes what frees up in turn, and a tenant sending through one replica gets that
        replica's part of the engine whatever its weight. None: no foreign load known."""
        foreign = pool.foreign
        if not foreign:
            return None
        tenants = self.tenants
        inflight, active = _global_load(pool, tenants)
        weight: dict[str, float] = {}
        held: dict[str, int] = {}  # in flight per tier, every replica
        for name in active:
            tier = tenants[name].tier
            weight[tier] = weight.get(tier, 0.0) + tenants[name].weight
            held[tier] = held.get(tier, 0) + inflight.get(name, 0)

        def share(name: str) -> float:
            # Of the slots, or of what the tier holds when the replicas together hold more
            # (each gates on its own in-flight count, so together they may exceed one
            # engine's slots while its waiting queue is short).
            spec = tenants[name]
            total = max(slots, held.get(spec.tier, 0))
            return total * spec.weight / weight[spec.tier] if weight.get(spec.tier) else total

        # Queued here too: with one-request DRR turns, a replica's own ring let the tenant
        # backlogged on every replica take its part here on top of its share (issue 15's
        # test: 0.43 of the tokens for the tenant behind one replica, 0.47 with this).
        local = {n for n, (_, queued) in pool.scheduler.active_load().items() if queued}
        starved = {tenants[n].tier for n, (_, backlogged) in foreign.items()
                   if backlogged and n in tenants and n in active
                   and inflight.get(n, 0) < share(n)}
        starved |= {tenants[n].tier for n in local
                    if n in tenants and inflight.get(n, 0) < share(n)}
        if not starved:
            return None

        def fair(name: str) -> bool:
            return tenants[name].tier not in starved or inflight.get(name, 0) < share(name)

        return fair


def _global_load(pool: Pool, tenants: Mapping[str, Tenant]) -> tuple[dict[str, int], set[str]]:
    """Each configured tenant's requests in flight across every replica, and the tenants
    active on some replica (in flight or backlogged there)."""
    inflight: dict[str, int] = {}
    active: set[str] = set()
    for name, (count, backlogged) in pool.foreign.items():
        if name not in tenants:
            continue
        inflight[name] = count
        if count or backlogged:
            active.add(name)
    for name, (here, _queued) in pool.scheduler.active_load().items():
        active.add(name)
        inflight[name] = inflight.get(name, 0) + here
    return inflight, active
