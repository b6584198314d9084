"""The egress selector chain: tier, then tenant (the fairness policy), then the tenant's own
queue (the ordering).

``Scheduler`` owns every queued request and the in-flight ones it handed out, and keeps the
aggregates that other parts read in O(1): queued requests/tokens per tier and tenant, the
backlogged weight of each tier (for the wait predictor) and each tenant's in-flight count
against its weighted share (for the admission headroom).

Policies
--------
The fairness policy (``sidecar.fairness``, named by ``scheduler.policy``) chooses among the
tenants of a tier: one of its flow structures per tier, fed the request costs in its own
unit of service (``Fairness.service``: DRR's turns, a request's cost over its endpoint's
quantum). Tiers are strict by rank (``sidecar.tiers``). A policy that does not choose among
tenants (``fcfs``, ``passthrough``) is served as one global FIFO by arrival, ignoring tiers,
tenants and priorities; ``holds_requests`` False (``passthrough``) means the shell dispatches
at once without waiting on the admission gate. The ordering (``scheduler.ordering``) ranks a
tenant's own requests.

Request lifecycle (the shell's side is in ``SchedulingCore``)
-------------------------------------------------------------
``enqueue`` -> QUEUED -> ``next`` -> DISPATCHED -> ``on_finished`` -> ENDED, or QUEUED ->
``cancel`` -> ENDED, or DISPATCHED -> ``requeue`` -> QUEUED (the backend never got it).
``next`` *is* the dispatch: it charges DRR and counts the request in flight, so there is no
separate ``on_dispatched`` here.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weighbridge.endpoints import EndpointKind
from weighbridge.sidecar.fairness import Fairness, Ordering
from weighbridge.sidecar.plugins import UnknownPlugin, plugin
from weighbridge.sidecar.queues import QueueLimits, TenantQueue
from weighbridge.sidecar.rejection import Reject
from weighbridge.sidecar.request import CostModel, QueuedRequest, RequestState, request_cost
from weighbridge.sidecar.tiers import TierSelector

if TYPE_CHECKING:
    from weighbridge.sidecar.config import Config
    from weighbridge.sidecar.config import Endpoint as ConfigEndpoint


# How deep into a held tenant's order ``Scheduler.next`` looks for a request that may pass
# its head: a bounded scan (the heap's top levels) on every dispatch pass that holds it.
PASS_SCAN = 4


@dataclass(frozen=True, slots=True)
class TenantSpec:
    tier: str  # the tenant's own (highest) tier; its requests may ask for lower ones
    weight: float = 1.0
    limits: QueueLimits = field(default_factory=QueueLimits)


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    cost: CostModel = "tokens"
    quantum: int = 2048  # endpoint units (tokens, or requests) per round: share and price
    # What one visit of the ring spends, per unit of weight, before the next tenant's
    # (sidecar.drr, "Turn size"); None: one request.
    turn: int | None = None


_DEFAULT_ENDPOINT = EndpointSpec()


def endpoint_turn(path: str, endpoint: ConfigEndpoint) -> int | None:
    """An endpoint's DRR turn per unit of weight (``Endpoint.turn``): as configured, else
    one request on the generating kinds (None) and a quantum on the others."""
    if endpoint.turn is not None:
        return endpoint.turn
    kind = EndpointKind.of_path(path)
    return None if kind is not None and kind.generates else endpoint.quantum


@dataclass(frozen=True, slots=True)
class BacklogView:
    """What is queued ahead of a new request, for the wait predictor (all O(1) aggregates).

    Tokens are ``QueuedRequest.computed_tokens``: what DRR charges, the cached prompt free.
    """

    fifo: bool  # fcfs/passthrough: everything queued is ahead, whoever sent it
    total_tokens: int  # everything queued, all tiers
    higher_tiers_tokens: int  # queued in tiers of lower rank number (served first)
    tier_tokens: int  # queued in the request's tier, all tenants
    tier_weight: float  # sum of weights of the tenants backlogged in that tier
    tenant_tokens: int  # the tenant's own queued tokens in that tier
    tenant_weight: float
    tenant_backlogged: bool  # whether tier_weight already includes tenant_weight


@dataclass(slots=True)
class _Tenant:
    name: str
    spec: TenantSpec
    weight: float  # spec.weight under drr; 1 under the weight-blind baselines
    queues: dict[str, TenantQueue] = field(default_factory=dict)  # by tier
    queued: int = 0
    queued_tokens: int = 0
    inflight: int = 0
    users: dict[str, int] = field(default_factory=dict)  # queued + in-flight per user
    active: bool = False  # queued or in flight: counts toward the active weight


@dataclass(slots=True)
class _Tier:
    name: str
    rank: int
    flows: Fairness  # the fairness policy's choice among the tier's tenants
    queued: int = 0
    queued_tokens: int = 0
    backlogged_tenants: int = 0
    backlogged_weight: float = 0.0


class Scheduler:
    def __init__(
        self,
        tiers: Mapping[str, int],
        tenants: Mapping[str, TenantSpec],
        endpoints: Mapping[str, EndpointSpec] | None = None,
        *,
        policy: str = "drr",
        anti_starvation_weight: float | None = None,
        repeat_demotion: bool = False,
        charge_streamed_tokens: bool = True,
        shortest_prompt_first: bool = False,
        ordering: str = "fifo",
    ) -> None:
        """``shortest_prompt_first``: the ordering of that name, whatever ``ordering``
        says (the configuration's older switch for it)."""
        try:
            fairness: type[Fairness] = plugin("fairness", policy)
            order: type[Ordering] = plugin(
                "ordering", "shortest_prompt_first" if shortest_prompt_first else ordering)
        except UnknownPlugin as e:
            raise ValueError(str(e)) from None
        self._fairness = fairness
        # An ordering may keep state (program_las: each program's service), so it is one
        # object per scheduler; ``delay_s`` and ``served`` are its optional hooks.
        self._order = order()
        self._rank = self._order.rank
        self._delay: Callable[[QueuedRequest], float] | None = getattr(
            self._order, "delay_s", None)
        self._served: Callable[[QueuedRequest, int], None] | None = getattr(
            self._order, "served", None)
        self._service = fairness.service
        self._selector = TierSelector(tiers, anti_starvation_weight)
        self._tiers = {name: _Tier(name, rank, fairness()) for name, rank in tiers.items()}
        self._check(tenants)
        self._tenants = {name: _Tenant(name, spec, self._weight(spec))
                         for name, spec in tenants.items()}
        self._endpoints = dict(endpoints or {})
        self._repeat_demotion = repeat_demotion
        self._charge_streamed = charge_streamed_tokens and fairness.costs_tokens
        self._seq = itertools.count()
        self._queued_index: dict[str, QueuedRequest] = {}
        self._dispatched: dict[str, QueuedRequest] = {}
        # fcfs/passthrough: (seq, request), a heap so a requeued request regains its place.
        self._fifo: list[tuple[int, QueuedRequest]] = []
        self._queued_tokens = 0
        self._booked: dict[tuple[str, str], float] | None = None  # share_service()
        self._active: set[str] = set()  # tenants with requests queued or in flight
        self._active_weight = 0.0
        self._active_tenants = 0
        self._retired: set[str] = set()  # removed by set_tenants, still in flight

    @classmethod
    def from_config(cls, config: Config) -> Scheduler:
        tenants = cls.tenant_specs(config)
        endpoints = {
            path: EndpointSpec(cost=e.cost, quantum=e.quantum, turn=endpoint_turn(path, e))
            for path, e in config.endpoints.items()
        }
        return cls(
            {name: tier.rank for name, tier in config.tiers.items()},
            tenants,
            endpoints,
            policy=config.scheduler.policy,
            anti_starvation_weight=config.scheduler.anti_starvation_weight,
            repeat_demotion=config.scheduler.repeat_demotion,
            shortest_prompt_first=config.scheduler.shortest_prompt_first is True,
            ordering=config.scheduler.ordering,
            charge_streamed_tokens=config.scheduler.charge_streamed_tokens,
        )

    @staticmethod
    def tenant_specs(config: Config) -> dict[str, TenantSpec]:
        return {
            name: TenantSpec(
                tier=t.tier,
                weight=t.weight,
                limits=QueueLimits(t.limits.max_queued, t.limits.max_queued_tokens),
            )
            for name, t in config.tenants.items()
        }

    def set_tenants(self, tenants: Mapping[str, TenantSpec]) -> None:
        """A reloaded configuration's tenants (sidecar.reload): a kept tenant keeps its
        queues, in-flight count and DRR credit and takes its new spec (a new weight counts
        from the next decision); a new one starts empty; a removed one must have nothing
        queued (end those first) and is forgotten once nothing of it is in flight."""
        self._check(tenants)
        for name in [n for n in self._tenants if n not in tenants]:
            gone = self._tenants[name]
            if gone.queued:
                raise ValueError(f"tenant {name!r} still has {gone.queued} queued")
            self._retired.add(name)
            self._forget_retired(gone)
        for name, spec in tenants.items():
            tenant = self._tenants.get(name)
            self._retired.discard(name)
            if tenant is None:
                self._tenants[name] = _Tenant(name, spec, self._weight(spec))
            else:
                tenant.spec = spec
                self._reweigh(tenant, self._weight(spec))

    def _check(self, tenants: Mapping[str, TenantSpec]) -> None:
        for name, spec in tenants.items():
            if spec.tier not in self._tiers:
                raise ValueError(f"tenant {name!r}: unknown tier {spec.tier!r}")
            if not spec.weight > 0:
                raise ValueError(f"tenant {name!r}: weight must be positive")

    def _weight(self, spec: TenantSpec) -> float:
        """The weight the policy gives a tenant: its own, or 1 where weights do not count."""
        return spec.weight if self._fairness.weighted else 1.0

    def _reweigh(self, tenant: _Tenant, weight: float) -> None:
        """A kept tenant's new weight, counted from the next decision."""
        delta, tenant.weight = weight - tenant.weight, weight
        if not delta:
            return
        if tenant.active:
            self._active_weight += delta
        for tier_name, queue in tenant.queues.items():
            tier = self._tiers[tier_name]
            if queue:
                tier.backlogged_weight += delta
            if self._fairness.per_tenant and tenant.name in tier.flows:
                tier.flows.add(tenant.name, weight)

    def _forget_retired(self, tenant: _Tenant) -> None:
        """A removed tenant leaves once nothing of it is queued or in flight."""
        if tenant.name in self._retired and not tenant.active:
            self._retired.discard(tenant.name)
            del self._tenants[tenant.name]

    # ------------------------------------------------------------------ properties

    @property
    def policy(self) -> str:
        """The fairness policy's registered name."""
        return self._fairness.name

    @property
    def holds_requests(self) -> bool:
        """False for passthrough: the shell forwards at once, ignoring the admission gate."""
        return self._fairness.holds_requests

    @property
    def uses_headroom(self) -> bool:
        """Whether admission headroom applies: only the tenant-aware policies can pick an
        under-share tenant; the FIFO baselines use the whole capacity as one pool."""
        return self._fairness.per_tenant

    @property
    def queued_requests(self) -> int:
        return len(self._queued_index)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def inflight_requests(self) -> int:
        return len(self._dispatched)

    def tenant_queued(self, tenant: str) -> tuple[int, int]:
        """(requests, computed tokens) queued by a tenant, all tiers."""
        t = self._tenants[tenant]
        return t.queued, t.queued_tokens

    def tenant_inflight(self, tenant: str) -> int:
        return self._tenants[tenant].inflight

    def tier_queued(self, tier: str) -> tuple[int, int]:
        t = self._tiers[tier]
        return t.queued, t.queued_tokens

    def endpoint(self, path: str) -> EndpointSpec:
        return self._endpoints.get(path, _DEFAULT_ENDPOINT)

    def deficit(self, tier: str, tenant: str) -> float:
        """A tenant's credit in a tier, in the policy's unit (0 if it never queued there)."""
        flows = self._tiers[tier].flows
        return flows.credit(tenant) if tenant in flows else 0.0

    def forfeited(self, tier: str, tenant: str) -> float:
        """Turns a tenant forfeited in a tier: rounds in which admission passed it over
        while others were served (Fairness.forfeited; 0 if it never queued there)."""
        flows = self._tiers[tier].flows
        return flows.forfeited(tenant) if tenant in flows else 0.0

    def queued_of(self, tenant: str) -> list[QueuedRequest]:
        """Every request ``tenant`` has queued, in all its tiers."""
        t = self._tenants.get(tenant)
        return [] if t is None else [r for q in t.queues.values() for r in q.ordered()]

    def queued(self, request_id: str) -> QueuedRequest | None:
        return self._queued_index.get(request_id)

    def dispatched(self, request_id: str) -> QueuedRequest | None:
        return self._dispatched.get(request_id)

    # ------------------------------------------------------------------ ingress

    def enqueue(self, request: QueuedRequest, now: float) -> Reject | None:
        """Queue a request, or say why not (``queue_full``). ``now`` is unused today: the
        order key uses the request's own ``arrival_s``; it is taken for API symmetry."""
        del now
        if request.state is not RequestState.NEW:
            raise ValueError(f"request {request.id!r} is {request.state.value}, not new")
        if request.id in self._queued_index or request.id in self._dispatched:
            raise ValueError(f"request id {request.id!r} is already in the scheduler")
        tenant = self._tenant(request.tenant)
        if request.tier not in self._tiers:
            raise ValueError(f"unknown tier {request.tier!r}")
        reject = tenant.spec.limits.check(
            tenant.queued, tenant.queued_tokens, request.computed_tokens
        )
        if reject is not None:
            return reject
        if self._repeat_demotion and request.user is not None:
            request.demotion = tenant.users.get(request.user, 0)
        request.seq = next(self._seq)
        request.size_rank = self._rank(request)
        if self._delay is not None:
            request.order_delay_s = self._delay(request)
        request.cost = request_cost(
            self.endpoint(request.endpoint).cost,
            request.prompt_tokens,
            request.estimated_output_tokens,
        )
        request.charged = 0
        self._insert(tenant, request)
        if request.user is not None:
            tenant.users[request.user] = tenant.users.get(request.user, 0) + 1
        if not self._fairness.per_tenant:
            heapq.heappush(self._fifo, (request.seq, request))
        self._touch_active(tenant)
        return None

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Remove a *queued* request at once (its client went away). Returns it, or None if
        it is not queued (unknown, already dispatched or ended). Nothing was charged to DRR
        for a queued request, so nothing is refunded there."""
        request = self._queued_index.get(request_id)
        if request is None:
            return None
        tenant = self._tenants[request.tenant]
        self._remove(tenant, request)
        self._forget_user(tenant, request)
        request.state = RequestState.ENDED
        self._touch_active(tenant)
        if len(self._fifo) > 2 * len(self._queued_index) + 64:
            self._fifo = [e for e in self._fifo if e[1].state is RequestState.QUEUED]
            heapq.heapify(self._fifo)
        return request

    # ------------------------------------------------------------------ egress

    def next(
        self, now: float, eligible: Callable[[str], bool] | None = None,
        passes: Callable[[QueuedRequest], bool] | None = None,
    ) -> QueuedRequest | None:
        """One dispatch decision: the request to send now, already counted in flight.

        ``eligible(tenant)`` restricts the choice (admission headroom: only under-share
        tenants); the FIFO policies ignore it. ``passes(request)``: a request of a tenant
        ``eligible`` holds back that may go anyway, looked for among the tenant's next
        ``PASS_SCAN`` requests in its order, so a request that fits where its tenant's head
        does not passes the head (the KV watermark's short requests, decision 0018).
        """
        if not self._queued_index:
            return None
        fifo = not self._fairness.per_tenant
        request = self._next_fifo() if fifo else self._next_fair(eligible, passes)
        if request is None:
            return None
        tenant = self._tenants[request.tenant]
        request.state = RequestState.DISPATCHED
        request.dispatched_s = now
        request.charged = request.cost
        self._dispatched[request.id] = request
        tenant.inflight += 1
        return request

    def _next_fifo(self) -> QueuedRequest | None:
        while self._fifo:
            _, request = heapq.heappop(self._fifo)
            if request.state is RequestState.QUEUED:
                self._remove(self._tenants[request.tenant], request)
                return request
        return None  # pragma: no cover - the index said something is queued

    def _next_fair(self, eligible: Callable[[str], bool] | None,
                   passes: Callable[[QueuedRequest], bool] | None) -> QueuedRequest | None:
        tiers = self._tiers
        for tier_name in self._selector.order(lambda name: tiers[name].queued > 0):
            tier = tiers[tier_name]
            passing: dict[str, QueuedRequest] = {}
            pick = eligible
            if eligible is not None and passes is not None:
                pick = self._passing(tier_name, eligible, passes, passing)
            flow = tier.flows.pick(pick)
            if flow is None:
                continue
            tenant = self._tenants[flow]
            queue = tenant.queues[tier_name]
            request = passing.get(flow)
            if request is None:
                request = queue.pop()
            else:
                queue.remove(request.id)
            del self._queued_index[request.id]
            self._account_removed(tenant, tier, request, queue)
            turns = self._turns(request, request.cost)
            spec = self.endpoint(request.endpoint)
            # A visit spends the tenant's weight in turns, so that within a round tenants
            # interleave in the ratio of their weights: a visit of one request whatever the
            # weight let a backlog of few requests (a closed loop's) empty at the round's
            # heavy end and forfeit the rest, below its weight (decision 0025).
            per_weight = turns if spec.turn is None else self._service(spec.turn, spec.quantum)
            tier.flows.consume(flow, turns, backlogged=bool(queue),
                               turn=tenant.weight * per_weight)
            self._book(request.tier, flow, turns)
            return request
        return None

    def _passing(self, tier: str, eligible: Callable[[str], bool],
                 passes: Callable[[QueuedRequest], bool],
                 found: dict[str, QueuedRequest]) -> Callable[[str], bool]:
        """``eligible``, or a request among the tenant's next ``PASS_SCAN`` that ``passes``
        (kept in ``found`` for the tenant the policy picks). The policy asks in its own
        order, and once a held tenant has none that passes no later one may pass either:
        passing jumps a tenant's own queue, never another tenant whose turn came first (a
        small request that fits beside another tenant's held large one would keep the room
        that one waits for, and DRR's token shares drifted to 1.11x)."""
        tenants = self._tenants
        stopped = False

        def pick(name: str) -> bool:
            nonlocal stopped
            if eligible(name):
                return True
            if not stopped:
                queue = tenants[name].queues.get(tier)
                for request in queue.first(PASS_SCAN) if queue else ():
                    if passes(request):
                        found[name] = request
                        return True
                stopped = True
            return False

        return pick

    def requeue(self, request: QueuedRequest) -> None:
        """Undo a dispatch the backend never received (connection refused before any byte):
        the request returns to its place in its tenant's order and its DRR charge is
        refunded, so the retry costs the tenant nothing. Queue bounds do not apply: the
        request was admitted already, and turning it away now would lose it."""
        if request.state is not RequestState.DISPATCHED:
            raise ValueError(f"request {request.id!r} is {request.state.value}, not dispatched")
        tenant = self._tenants[request.tenant]
        del self._dispatched[request.id]
        tenant.inflight -= 1
        charged = request.charged
        request.state = RequestState.QUEUED
        request.charged = 0
        request.streamed_output_tokens = 0
        request.dispatched_s = None
        request.backend = None
        self._insert(tenant, request)
        if not self._fairness.per_tenant:
            heapq.heappush(self._fifo, (request.seq, request))
        else:
            # After _insert: re-activation first, so the refund restores credit instead of
            # being clamped away on an idle flow.
            turns = -self._turns(request, charged)
            self._tiers[request.tier].flows.adjust(request.tenant, turns)
            self._book(request.tier, request.tenant, turns)
        self._touch_active(tenant)

    # ------------------------------------------------------------------ in flight

    def on_tokens_streamed(self, request: QueuedRequest, tokens: int) -> None:
        """Output tokens passed through the sidecar. With ``charge_streamed_tokens`` (drr,
        token-cost endpoints), tokens beyond what was charged at dispatch are charged now,
        VTC-style, so a long generation pays while it runs rather than at its end."""
        if request.state is not RequestState.DISPATCHED or tokens <= 0:
            return
        request.streamed_output_tokens += tokens
        self.charge_streamed(request)

    def charge_streamed(self, request: QueuedRequest) -> None:
        """Charge what ``request.streamed_output_tokens`` says beyond what was charged (the
        charging half of ``on_tokens_streamed``, for a count already kept)."""
        if request.state is not RequestState.DISPATCHED or not self._charge_streamed \
                or self.endpoint(request.endpoint).cost != "tokens":
            return
        excess = (request.computed_prompt_tokens + request.streamed_output_tokens
                  - request.charged)
        if excess > 0:
            turns = self._turns(request, excess)
            self._tiers[request.tier].flows.adjust(request.tenant, turns)
            self._book(request.tier, request.tenant, turns)
            request.charged += excess

    def discount_cached(self, request: QueuedRequest) -> None:
        """The request's backend is predicted to hold part of its prompt in its prefix cache
        (``predicted_cached_tokens``, set at dispatch): that part is refunded, for the
        engine does not compute it. Its end settles the charge with what the engine
        reported."""
        cached = request.predicted_cached_tokens
        if (request.state is not RequestState.DISPATCHED or cached <= 0
                or not self._fairness.costs_tokens
                or self.endpoint(request.endpoint).cost != "tokens"):
            return
        turns = -self._turns(request, cached)
        self._tiers[request.tier].flows.adjust(request.tenant, turns)
        self._book(request.tier, request.tenant, turns)
        request.charged -= cached

    def on_finished(self, request: QueuedRequest, prompt_tokens: int, output_tokens: int) -> None:
        """A dispatched request ended (completed, failed or cancelled mid-stream): settle
        its DRR charge with the real counts (``usage``, or what was produced before it
        failed) and release its in-flight slot."""
        if request.state is not RequestState.DISPATCHED:
            raise ValueError(f"request {request.id!r} is {request.state.value}, not dispatched")
        tenant = self._tenants[request.tenant]
        actual = request_cost(self.endpoint(request.endpoint).cost, prompt_tokens, output_tokens)
        if self._fairness.costs_tokens:
            turns = self._turns(request, actual - request.charged)
            self._tiers[request.tier].flows.adjust(request.tenant, turns)
            self._book(request.tier, request.tenant, turns)
        request.charged = actual
        if self._served is not None:
            # What its engine computed: the prompt its cache was predicted not to hold.
            self._served(request, max(0, prompt_tokens - request.predicted_cached_tokens)
                         + output_tokens)
        del self._dispatched[request.id]
        tenant.inflight -= 1
        self._forget_user(tenant, request)
        request.state = RequestState.ENDED
        self._touch_active(tenant)
        if self._retired:
            self._forget_retired(tenant)

    # ------------------------------------------------------------------ other replicas

    def _book(self, tier: str, tenant: str, turns: float) -> None:
        if self._booked is not None and turns:
            key = (tier, tenant)
            self._booked[key] = self._booked.get(key, 0.0) + turns

    def share_service(self) -> None:
        """Keep what each tenant is charged (``take_booked``), so that replicas sharing the
        tenants can judge shares across all of them (sidecar.shared)."""
        if self._booked is None:
            self._booked = {}

    def take_booked(self) -> dict[tuple[str, str], float]:
        """Service charged per (tier, tenant) since the last call, in the fairness policy's
        unit (DRR's turns): dispatch costs, live charges, settlements and refunds."""
        taken = self._booked or {}
        if self._booked is not None:
            self._booked = {}
        return taken

    def active_load(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (in flight, queued), for the configured tenants with either (a tenant a
        reload removed is not judged for shares while its last requests finish)."""
        return {name: (t.inflight, t.queued) for name in self._active
                if (t := self._tenants[name]).active and name not in self._retired}

    def queued_flows(self) -> list[tuple[str, str]]:
        """(tier, tenant) of every tenant queue with requests waiting."""
        return [(tier, t.name) for t in self._tenants.values() if t.queued
                for tier, queue in t.queues.items() if queue]

    def charge_foreign(self, tier: str, tenant: str, turns: float) -> None:
        """Service another replica gave ``tenant`` in ``tier``, in the policy's unit: charged as
        if served here, so this replica orders its queue by the tenant's service across
        every replica. A tenant that never queued here in that tier has no credit to charge
        (its service elsewhere before it arrives here is not held against it)."""
        known = self._tiers.get(tier)
        flows = None if known is None else known.flows
        if flows is not None and tenant in flows and turns:
            flows.adjust(tenant, turns)

    # ------------------------------------------------------------------ shares

    def under_share(self, tenant: str, slots: float) -> bool:
        """Whether ``tenant`` holds fewer in-flight requests than its weighted share of
        ``slots`` among the active tenants (those with queued or in-flight work). Only such
        tenants may use the admission headroom."""
        t = self._tenants[tenant]
        if self._active_weight <= 0:
            return True
        return t.inflight < slots * t.weight / self._active_weight

    def share_fraction(self, tenant: str) -> float:
        """The tenant's weighted share among the active tenants (itself counted as active):
        1 when alone. What KV-aware admission scales the KV watermark by."""
        t = self._tenants[tenant]
        active = self._active_weight + (0.0 if t.active else t.weight)
        return t.weight / active if active > 0 else 1.0

    def over_share(self, tenant: str, slots: float, recent: Iterable[str] = ()) -> bool:
        """Whether ``tenant`` holds more in-flight requests than its weighted share (checked
        after a dispatch: its latest request is the one over the share). Tenants in
        ``recent`` (active lately, idle now) count toward the active weight as if active:
        a tenant whose requests come one at a time is idle between them, and a share judged
        without it hands the whole engine to the flood at the moment it next arrives."""
        t = self._tenants[tenant]
        weight = self._active_weight + sum(
            other.weight for name in recent if name != tenant
            and (other := self._tenants.get(name)) is not None and not other.active)
        if weight <= 0:
            return False
        return t.inflight > slots * t.weight / weight

    def backlog_view(self, tier: str, tenant: str) -> BacklogView:
        t = self._tenant(tenant)
        tier_state = self._tiers[tier]
        queue = t.queues.get(tier)
        higher = sum(
            other.queued_tokens
            for other in self._tiers.values()
            if other.rank < tier_state.rank
        )
        return BacklogView(
            fifo=not self._fairness.per_tenant,
            total_tokens=self._queued_tokens,
            higher_tiers_tokens=higher,
            tier_tokens=tier_state.queued_tokens,
            tier_weight=tier_state.backlogged_weight,
            tenant_tokens=queue.tokens if queue else 0,
            tenant_weight=t.weight,
            tenant_backlogged=bool(queue),
        )

    def backlog_tokens(self, tier: str, tenant: str | None = None) -> int:
        """Queued computed tokens in a tier, or of one tenant in it."""
        if tenant is None:
            return self._tiers[tier].queued_tokens
        queue = self._tenant(tenant).queues.get(tier)
        return queue.tokens if queue else 0

    # ------------------------------------------------------------------ internals

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            raise ValueError(f"unknown tenant {name!r}")
        return tenant

    def _turns(self, request: QueuedRequest, amount: float) -> float:
        """A cost in the policy's unit of service (DRR's turns of the endpoint's quantum), at
        the request's service-cost factor (1 unless ``scheduler.service_cost``)."""
        return self._service(amount * request.cost_factor,
                             self.endpoint(request.endpoint).quantum)

    def _insert(self, tenant: _Tenant, request: QueuedRequest) -> None:
        tier = self._tiers[request.tier]
        queue = tenant.queues.get(request.tier)
        if queue is None:
            queue = tenant.queues[request.tier] = TenantQueue()
        was_empty = not queue
        queue.push(request)
        request.state = RequestState.QUEUED
        self._queued_index[request.id] = request
        tokens = request.computed_tokens
        tier.queued += 1
        tier.queued_tokens += tokens
        tenant.queued += 1
        tenant.queued_tokens += tokens
        self._queued_tokens += tokens
        if was_empty:
            tier.backlogged_tenants += 1
            tier.backlogged_weight += tenant.weight
            if self._fairness.per_tenant:
                if tenant.name not in tier.flows:
                    tier.flows.add(tenant.name, tenant.weight)
                tier.flows.activate(tenant.name)

    def _remove(self, tenant: _Tenant, request: QueuedRequest) -> None:
        """Take a queued request out of its queue (cancel, or FIFO dispatch)."""
        queue = tenant.queues[request.tier]
        queue.remove(request.id)
        del self._queued_index[request.id]
        tier = self._tiers[request.tier]
        self._account_removed(tenant, tier, request, queue)
        if not queue and self._fairness.per_tenant:
            tier.flows.deactivate(tenant.name)

    def _account_removed(
        self, tenant: _Tenant, tier: _Tier, request: QueuedRequest, queue: TenantQueue
    ) -> None:
        tokens = request.computed_tokens
        tier.queued -= 1
        tier.queued_tokens -= tokens
        tenant.queued -= 1
        tenant.queued_tokens -= tokens
        self._queued_tokens -= tokens
        if not queue:
            tier.backlogged_tenants -= 1
            # Sums of float weights drift; an empty tier is exactly zero again.
            tier.backlogged_weight = (
                tier.backlogged_weight - tenant.weight if tier.backlogged_tenants else 0.0
            )

    def _forget_user(self, tenant: _Tenant, request: QueuedRequest) -> None:
        if request.user is None:
            return
        left = tenant.users[request.user] - 1
        if left:
            tenant.users[request.user] = left
        else:
            del tenant.users[request.user]

    def _touch_active(self, tenant: _Tenant) -> None:
        active = tenant.queued > 0 or tenant.inflight > 0
        if active == tenant.active:
            return
        tenant.active = active
        if active:
            self._active.add(tenant.name)
        else:
            self._active.discard(tenant.name)
        self._active_tenants += 1 if active else -1
        if self._active_tenants == 0:
            self._active_weight = 0.0
        else:
            self._active_weight += tenant.weight if active else -tenant.weight

    # ------------------------------------------------------------------ admin

    def snapshot(self, max_tenants: int | None = 100, max_requests: int = 10) -> dict[str, Any]:
        """Plain dicts for /admin/state: tiers, and the busiest tenants' queues and deficits."""
        busy = sorted(
            (t for t in self._tenants.values() if t.active),
            key=lambda t: (-t.queued, -t.inflight, t.name),
        )
        if max_tenants is not None:
            busy = busy[:max_tenants]
        tenants: dict[str, Any] = {}
        for t in busy:
            tenants[t.name] = {
                "tier": t.spec.tier,
                "weight": t.spec.weight,
                "queued": t.queued,
                "queued_tokens": t.queued_tokens,
                "inflight": t.inflight,
                "deficit_turns": {
                    name: tier.flows.credit(t.name)
                    for name, tier in self._tiers.items()
                    if t.name in tier.flows
                },
                "queues": {
                    tier: [
                        {
                            "id": r.id,
                            "priority": r.effective_priority,
                            "deadline_s": r.deadline_s,
                            "arrival_s": r.arrival_s,
                            "estimated_tokens": r.estimated_tokens,
                        }
                        for r in queue.ordered(max_requests)
                    ]
                    for tier, queue in t.queues.items()
                    if queue
                },
            }
        return {
            "policy": self._fairness.name,
            "queued": self.queued_requests,
            "queued_tokens": self._queued_tokens,
            "inflight": self.inflight_requests,
            "active_tenants": self._active_tenants,
            "active_weight": self._active_weight,
            "tiers": {
                name: {
                    "rank": tier.rank,
                    "queued": tier.queued,
                    "queued_tokens": tier.queued_tokens,
                    "backlogged_tenants": tier.backlogged_tenants,
                    "backlogged_weight": tier.backlogged_weight,
                    "round": tier.flows.round,
                }
                for name, tier in self._tiers.items()
            },
            "tier_yield_credit": self._selector.snapshot(),
            "tenants": tenants,
        }
