"""The whole scheduling core behind one object: what the HTTP shell calls, and nothing else.

``SchedulingCore`` keeps each request's lifecycle: it wires the rate limiter, output
estimator, wait predictor, each pool's scheduler, the fleet's records (sidecar.fleet: each
backend's gate, KV footprint, prefix index and load), the dispatch cycle (sidecar.cycle:
standings, eligible tenants, the fairness pick, the scored backends) and the ledger in the
order the design fixes, so that the shell cannot get the order or the accounting wrong:
every request that ``arrive`` accepts ends exactly once, through ``cancel``,
``on_completed``, ``on_failed`` or ``on_client_gone``. ``stats()`` is what /metrics reads.

Shell contract (all methods take ``now``: one monotonic clock, seconds)
---------------------------------------------------------------------
Ingress, per authenticated request::

    result = core.arrive(request_id=..., tenant=..., tier=..., endpoint=..., now=...,
                         prompt_tokens=..., max_tokens=..., user=..., priority=...,
                         deadline_s=config.tiers[tier].deadline(now, header_ms),
                         deadline_covers_output=config.tiers[tier].deadline_covers_output(
                             header_ms))
    if isinstance(result, Reject): respond 429/503 with result.reason / retry_after_s
    else: wait for the request's dispatch (keep `result`, the QueuedRequest)

  Requests turned away before they have a tenant (401, 400, 413) are counted with
  ``core.ledger.rejected_on_arrival(tenant, tier, reason)``.

Egress: after *any* event that can free capacity or add work (an arrival, a completion,
failure or cancellation, a metrics scrape or a failed scrape, a backend turning healthy) and
on a periodic tick (``metrics_poll_ms``; staleness is time-driven), run
``for d in core.dispatch_ready(now): start_proxying(d)``. Each ``Dispatch`` names the request,
the backend, and the ``priority`` to put in the body (None: remove the field).

While a request is in flight::

    core.on_first_token(req, now)            # first content chunk (prefill done)
    core.on_tokens_streamed(req, n, now)     # n output tokens passed to the client
    # then exactly one of:
    core.on_completed(req, usage.prompt_tokens, usage.completion_tokens, now)
    core.on_client_gone(req, prompt_tokens, output_tokens_so_far, now)  # after aborting upstream
    core.on_failed(req, prompt_tokens, output_tokens_so_far, now)       # backend error
    core.dispatch_failed(req, now)  # the backend never got it (connect refused): requeued

  A client that disconnects while its request is still queued: ``core.cancel(id, now)``.
  A backend that fails: ``core.mark_backend_unhealthy(name)`` (then ``on_failed`` for its
  streams, or ``dispatch_failed`` for requests it refused); ``mark_backend_healthy`` when the
  probe succeeds. Scrapes: ``core.on_backend_metrics(name, sample)`` (the scrape
  contract, ``weighbridge.vllm_metrics.BackendSample``); a failed
  scrape needs no call (the last sample goes stale and the fallback cap applies).

Streamed tokens
---------------
``on_tokens_streamed`` comes once per chunk relayed, so it is the core's hottest call. After a
request's first token it only counts (``streamed_output_tokens`` is always current) and
notes the request; the tokens are *folded* into the DRR charge, the route's outstanding
tokens, the KV footprint and the throughput meter (at the time the last of them passed) by
the next public entry: every method marked ``@_entry`` folds before its body runs, and every
other public method reads nothing a fold changes (tests/unit/sidecar/test_core_entries.py
checks the split). So no decision, view or end sees a different state than token-by-token
folding gives, while a stream's tokens between two entries cost one fold instead of one each
(docs/sidecar-performance.md). The ``fleet``, ``scheduler`` and ``meter`` properties are
plain reads: a caller reading them between entries calls ``fold_streamed()`` first.

Several replicas
----------------
``sidecar.replica`` wraps the core for the replica protocol through a narrow interface: the
limits and the estimator, ``pools()``, ``record_for_replicas()`` and ``learn_sent_prefix``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import wraps
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from weighbridge.sidecar.admission import (
    AdmissionGate,
    GateLimits,
    derive_limits,
    vllm_priority,
)
from weighbridge.sidecar.catalog import ModelCatalog
from weighbridge.sidecar.cycle import DispatchCycle, Pool, light_tenants, share_slots
from weighbridge.sidecar.estimator import OutputEstimator
from weighbridge.sidecar.fleet import Backend, Fleet
from weighbridge.sidecar.ledger import Ledger, Outcome, Tally
from weighbridge.sidecar.predictor import ThroughputMeter, WaitPredictor, decode_s
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.ratelimit import Admit, LimitTable, TenantRateLimiter, limited_tokens
from weighbridge.sidecar.rejection import (
    DEADLINE_UNMEETABLE,
    MODEL_NOT_FOUND,
    TENANT_REMOVED,
    Reject,
)
from weighbridge.sidecar.request import QueuedRequest, RequestState
from weighbridge.sidecar.routing import Route
from weighbridge.sidecar.scheduler import Scheduler
from weighbridge.sidecar.service_cost import ServiceCost
from weighbridge.sidecar.shape import EngineShape
from weighbridge.sidecar.stability import current_pools, learned_step_s, step_budget
from weighbridge.vllm_metrics import BackendSample

if TYPE_CHECKING:
    from collections.abc import Iterator

    from weighbridge.sidecar.config import Config




_P = ParamSpec("_P")
_R = TypeVar("_R")


def _entry(
    method: Callable[Concatenate[SchedulingCore, _P], _R],
) -> Callable[Concatenate[SchedulingCore, _P], _R]:
    """A public entry of the core: every stream's counted tokens are folded in before it runs
    (module doc, "Streamed tokens")."""

    @wraps(method)
    def entry(self: SchedulingCore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._unfolded:
            self._fold_streamed()
        return method(self, *args, **kwargs)

    entry.folds_first = True  # type: ignore[attr-defined]
    return entry


def _limit_table(config: Config) -> LimitTable:
    """Every rate limit the configuration declares, by scope."""
    return LimitTable(
        {name: t.limits for name, t in config.tenants.items()},
        {(tenant, path): limits for tenant, t in config.tenants.items()
         for path, limits in t.endpoint_limits.items()},
        {name: tier.limits for name, tier in config.tiers.items()},
        endpoint_defaults={path: e.tenant_limits for path, e in config.endpoints.items()},
        model_limits={(tenant, model): limits for tenant, t in config.tenants.items()
                      for model, limits in t.model_limits.items()},
        model_defaults={name: m.tenant_limits for name, m in config.models.items()},
    )


@dataclass(slots=True)
class ReplicaRecord:
    """What the core keeps for the replicas it shares limits and backends with, until
    sidecar.replica takes it."""

    # Settlements and refunds owed to the limits replicas share: (request, token delta),
    # positive a further charge, negative a refund.
    charges: list[tuple[QueuedRequest, int]] = field(default_factory=list)
    # (backend, block size, chained block hashes) of every prompt sent, while ``sharing``.
    sent_prefixes: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    # Prompt tokens (times answers) sent to each backend, while ``sharing``: the others'
    # part of the engine's prefix-cache lookups (sidecar.prefix.CacheShare).
    sent_tokens: Counter[str] = field(default_factory=Counter)
    # (tenant, session, backend) of every request naming a session, while ``sharing``: the
    # others' session_affinity binds it too.
    sent_sessions: list[tuple[str, str, str]] = field(default_factory=list)
    # Replicas are told of service, estimates and prompts (``record_for_replicas``).
    sharing: bool = False


@dataclass(frozen=True, slots=True)
class Dispatch:
    request: QueuedRequest
    backend: str
    # The `priority` body field for this backend; None when the backend does not run
    # --scheduling-policy priority (the shell removes the field then).
    vllm_priority: int | None
    over_share: bool  # the tenant now holds more than its weighted share of slots


@dataclass(frozen=True, slots=True)
class TenantStats:
    tenant: str
    tier: str  # the tenant's own tier
    weight: float
    queued_tokens: int  # estimated, over all its queues
    deficit_quanta: float  # its DRR credit in its tier (negative: debt)
    forfeited_quanta: float  # quanta it did not get while admission passed it over


@dataclass(frozen=True, slots=True)
class BackendStats:
    backend: str
    healthy: bool
    inflight: int  # our requests there
    outstanding_tokens: float  # prompt plus expected remaining output in flight
    prefill_tokens: int  # prompt tokens dispatched there with no first token yet
    cap: int  # the admission cap in force
    decode_tokens_per_s_per_seq: float | None
    learned_step_s: float | None  # its engine's step time as learned (stability's t_step)
    prefix_index_blocks: int  # blocks its prefix index holds
    prefix_cache_share: float  # of its prefix cache, what the sidecar's prompts hold


@dataclass(frozen=True, slots=True)
class CoreStats:
    """What the core has counted, as /metrics shows it: read-only values, not the parts."""

    tallies: dict[tuple[str, str], Tally]  # per (tenant, tier); copies
    tenants: tuple[TenantStats, ...]  # every configured tenant
    holds: dict[tuple[str, str], int]  # (backend or "", reason) -> dispatches held
    tokens_per_s: float | None  # measured throughput feeding the wait predictors
    backends: tuple[BackendStats, ...]
    models: dict[str, Tally]  # per model served ("" for a request naming none); copies
    served: dict[str, tuple[str, ...]]  # backend -> the models it serves, where known
    # Prompt tokens cached, by (tenant, backend): predicted at dispatch, and reported by the
    # engine at the end, of the requests that have both.
    cached_predicted: dict[tuple[str, str], int]
    cached_reported: dict[tuple[str, str], int]
    # The route's choices where affinity was weighed, by (backend, reason).
    routing_decisions: dict[tuple[str, str], int]
    pools: set[frozenset[str]]  # the pools requests arrive for now (stability.current_pools)
    step_budget: int  # the engines' step budget utilisation is counted in

    @property
    def healthy_backends(self) -> list[str]:
        return [b.backend for b in self.backends if b.healthy]


class SchedulingCore:
    def __init__(self, config: Config, *, gate_limits: GateLimits | None = None) -> None:
        """``gate_limits`` fixes every backend's admission limits (tests); without it each
        backend's are derived from ``config.admission`` and the engine's learned shape
        (``weighbridge.sidecar.admission.derive_limits``), and change as the shape is learned."""
        # In-flight requests with streamed output not yet folded in (module doc); first,
        # as every entry reads it.
        self._unfolded: dict[str, QueuedRequest] = {}
        self.config = config
        # Which backends serve which model (discovered from /v1/models, or declared); each
        # distinct set of backends is a pool with its own queues (sidecar.catalog).
        self.catalog = ModelCatalog(
            [b.name for b in config.backends],
            {b.name: b.models for b in config.backends if b.models is not None},
            config.default_model)
        self._pools: dict[frozenset[str], Pool] = {}
        self._record = ReplicaRecord()  # for sidecar.replica
        self._default_pool = self._pool(self.catalog.backends)
        self._pool_of: dict[str, Pool] = {}  # queued or in-flight request -> its pool
        self.estimator = OutputEstimator(
            {path: e.initial_output_estimate for path, e in config.endpoints.items()},
            config.scheduler.output_estimate_alpha,
        )
        # Engine seconds per token by key, to charge by (opt-in: scheduler.service_cost).
        self.service_cost = ServiceCost() if config.scheduler.service_cost else None
        self.limit_table = _limit_table(config)
        # This process's own buckets: every limit when it runs alone; its share of them
        # (sidecar.replica) while the limits replicas share cannot be reached.
        self.rate_limiter = TenantRateLimiter(self.limit_table)
        self._gate_limits = gate_limits
        # Every backend, one record each (sidecar.fleet).
        self.fleet = Fleet()
        self.fleet.reconfigure(config.backends, self._new_gate, healthy=True)
        self.route = Route(config.routing)
        self.route.session_ttl(config.programs.affinity_ttl_s)
        # The dispatch decision (sidecar.cycle): it counts the holds and routing choices.
        self._cycle = DispatchCycle(self.fleet, self.route, config.tenants)
        self.holds = self._cycle.holds
        self.routing_decisions = self._cycle.routing_decisions
        self.ledger = Ledger()
        self._tier_priority = {name: t.vllm_priority for name, t in config.tiers.items()}
        self._demotion = config.admission.over_share_priority_demotion
        self._reported: dict[str, int] = {}  # tokens of each in-flight request fed to the meter
        self._prefilled: set[str] = set()  # in-flight requests whose prompt was reported
        # Prompt tokens cached, by (tenant, backend): predicted at dispatch, and reported
        # by the engine at the end, of the requests that have both.
        self.cached_predicted: Counter[tuple[str, str]] = Counter()
        self.cached_reported: Counter[tuple[str, str]] = Counter()

    def _new_gate(self) -> AdmissionGate:
        """A backend's gate: the fixed limits (tests), or derived from its learned shape."""
        if self._gate_limits is not None:
            return AdmissionGate(self._gate_limits)
        admission, tenant_aware = self.config.admission, self.scheduler.uses_headroom

        def derive(shape: EngineShape) -> GateLimits:
            return derive_limits(admission, shape, tenant_aware)

        return AdmissionGate(derive(EngineShape()), derive)

    # ------------------------------------------------------------------ reload

    @_entry
    def reconfigure(self, config: Config, now: float) -> list[QueuedRequest]:
        """Take a reloaded configuration, between two decisions (sidecar.reload has checked
        that it changes only what may change live). Every kept tenant, bucket, DRR credit,
        queue and learned backend shape carries over; the new definitions apply from the
        next decision. The queued requests of removed tenants are ended here, rejected
        ``tenant_removed``, and returned for the shell to answer; their in-flight requests
        finish. A removed backend drains (``draining``: no new work, forgotten when its last
        request ends); an added one takes no work until ``mark_backend_healthy``."""
        removed = set(self.config.tenants) - set(config.tenants)
        evicted: list[QueuedRequest] = []
        for pool in self._pools.values():
            for tenant in removed:
                evicted += pool.scheduler.queued_of(tenant)
        for request in evicted:
            self._pool_of.pop(request.id).scheduler.cancel(request.id)
            self._refund(request, now)
            self.ledger.end(request.id, Outcome.REJECTED, TENANT_REMOVED)
        self.config = config
        self._cycle.tenants = config.tenants
        specs = Scheduler.tenant_specs(config)
        for pool in self._pools.values():
            pool.scheduler.set_tenants(specs)
            for tenant in removed:
                pool.light.pop(tenant, None)
        self.limit_table = _limit_table(config)
        self.rate_limiter.retable(self.limit_table, now)
        self._tier_priority = {name: t.vllm_priority for name, t in config.tiers.items()}
        added, gone = self.fleet.reconfigure(config.backends, self._new_gate)
        names = [b.name for b in config.backends]
        self.catalog.reconfigure(
            names, {b.name: b.models for b in config.backends if b.models is not None})
        joining = frozenset(name for name in added if not self.catalog.known(name))
        pools: dict[frozenset[str], Pool] = {}
        for key, pool in self._pools.items():
            # Unknown backends serve every model (sidecar.catalog): they join every pool.
            pool.backends = (pool.backends - gone) | joining
            # Two pools that now cover the same backends stay apart (the second under its
            # old key) until the older one's queue empties: merging queues would reorder them.
            pools[key if pool.backends in pools else pool.backends] = pool
        self._pools = pools
        return evicted

    def has_backend(self, backend: str) -> bool:
        """Whether the core still knows ``backend`` (configured, or draining)."""
        return backend in self.fleet

    @property
    def draining(self) -> frozenset[str]:
        """Backends a reload removed, still finishing what they have in flight."""
        return self.fleet.draining

    @property
    def unreported(self) -> frozenset[str]:
        """Backends whose answers lack cached_tokens (vLLM without
        --enable-prompt-tokens-details): charged the whole prompt, as if nothing cached."""
        return frozenset(b.name for b in self.fleet if b.unreported)

    # ------------------------------------------------------------------ pools

    # The parts, as plain reads: current as of the last entry (``fold_streamed``).

    @property
    def scheduler(self) -> Scheduler:
        """The queues of the pool of every backend: the only pool of a fleet serving one set
        of models (or before any backend has said what it serves)."""
        return self._default_pool.scheduler

    @property
    def meter(self) -> ThroughputMeter:
        """The throughput measured in the pool of every backend (``scheduler``'s)."""
        return self._default_pool.meter

    @_entry
    def fold_streamed(self) -> None:
        """Fold every stream's counted tokens in now (the entry does it), for a caller about
        to read the parts above."""

    def _pool(self, backends: frozenset[str]) -> Pool:
        pool = self._pools.get(backends)
        if pool is None:
            scheduler = Scheduler.from_config(self.config)
            if self._record.sharing:
                scheduler.share_service()
            meter = ThroughputMeter()
            pool = Pool(backends, scheduler, meter, WaitPredictor(scheduler, meter), {})
            self._pools[backends] = pool
        return pool

    def serves(self, model: str | None) -> bool:
        """Whether some backend may serve ``model`` (None or "": the default model); a
        request for one that none serves is turned away (``MODEL_NOT_FOUND``) uncharged."""
        return bool(self.catalog.backends_for(model or None))

    def pool_for(self, request_id: str) -> frozenset[str] | None:
        """The backends a queued or in-flight request may go to."""
        pool = self._pool_of.get(request_id)
        return None if pool is None else pool.backends

    def on_backend_models(self, backend: str, models: list[str]) -> bool:
        """What a backend's /v1/models lists; True if the catalog changed. Requests already
        queued keep their pool; new arrivals use the new one."""
        return self.catalog.learn(backend, models)

    def request_model(self, model: str | None) -> str | None:
        """The model per-model limits charge a request naming ``model`` to: its own, or
        ``default_model`` for one naming none ("" included, as vLLM reads it)."""
        return model or self.config.default_model

    # ------------------------------------------------------------------ other replicas

    @_entry
    def record_for_replicas(self) -> ReplicaRecord:
        """From now on, keep what replicas sharing this core's tenants need (sidecar.replica):
        every pool's service (``Scheduler.share_service``), every output observation
        (``estimator.take_observations``) and every prompt sent; returns the record the
        charges and prompts go to."""
        self._record.sharing = True
        self.estimator.share()
        for pool in self._pools.values():
            pool.scheduler.share_service()
        return self._record

    @_entry
    def pools(self) -> list[Pool]:
        """Every pool: its backends, its queues and the load other replicas hold on it."""
        return list(self._pools.values())

    def learn_sent_prefix(self, backend: str, block_size: int, blocks: Sequence[int]) -> None:
        """Another replica sent a prompt of these blocks to ``backend``: its index holds
        them now as if sent from here (an unknown backend or another block size: nothing)."""
        record = self.fleet.get(backend)
        if record is not None and record.prefix.block_size == block_size:
            record.prefix.sent_blocks(blocks)

    def learn_session(self, tenant: str, session: str, backend: str, now: float) -> None:
        """Another replica sent ``tenant``'s ``session`` to ``backend``, told at ``now``:
        session affinity binds it here too (an unknown backend: nothing)."""
        if backend in self.fleet:
            self.route.learn_session(tenant, session, backend, now)

    def learn_sent_tokens(self, backend: str, tokens: int, now: float) -> None:
        """Other replicas sent ``backend`` prompts of ``tokens`` tokens (times answers), told
        at ``now``: part of the engine's prefix-cache lookups, as this replica's prompts are
        (taken as admitted when told: their first tokens are the others' to see)."""
        record = self.fleet.get(backend)
        if record is not None:
            record.prefix.cache_share.sent(tokens)
            record.prefix.cache_share.admitted(tokens, now)

    # ------------------------------------------------------------------ ingress

    @_entry
    def arrive(
        self,
        *,
        request_id: str,
        tenant: str,
        tier: str,
        endpoint: str,
        prompt_tokens: int,
        max_tokens: int | None,
        now: float,
        sequences: int = 1,
        user: str | None = None,
        session: str | None = None,
        program: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        deadline_covers_output: bool = False,
        model: str | None = None,
        admitted: Admit | Reject | None = None,
        prefix: PromptPrefix | None = None,
        allowed_backends: frozenset[str] | None = None,
    ) -> QueuedRequest | Reject:
        """Rate limit, early rejection, bounded queue, in that order; a request that passes
        all three is queued and returned. ``admitted``: the verdict of the limits several
        replicas share (sidecar.shared), already taken for this request's estimate
        (``estimated_tokens``); None: this process's own limiter decides.
        ``deadline_covers_output``: the deadline is for the whole answer
        (``deadline_covers_output``), so early rejection adds the time to decode it.
        ``session``: the client's session id (its ``x-session-id`` header), for the routes
        that keep a session's turns together (``session_affinity``). ``program``: the
        agent program family it is a call of (sidecar.programs), for ``program_las``.
        ``allowed_backends``:
        the only backends it may go to (an endpoint picker's subset); it queues in the pool
        of those that serve its model, as a model served by some backends does."""
        if tenant not in self.config.tenants:
            raise ValueError(f"unknown tenant {tenant!r} (authenticate first)")
        if tier not in self.config.tiers:
            raise ValueError(f"unknown tier {tier!r}")
        model = model or None  # "" is no model, as vLLM reads it (it serves its own)
        backends = self.catalog.backends_for(model)
        backends = backends if allowed_backends is None else backends & allowed_backends
        if not backends:
            # Before any limit is charged: no backend could ever serve it. Not counted under
            # its name, which the client chose (a metric label per typo is unbounded).
            self.ledger.arrive(request_id, tenant, tier)
            self.ledger.end(request_id, Outcome.REJECTED, MODEL_NOT_FOUND)
            return Reject(MODEL_NOT_FOUND, None, f"The model `{model}` does not exist.")
        self.ledger.arrive(request_id, tenant, tier,
                           model if model is not None else self.catalog.default_model() or "")
        pool = self._pool(backends)
        self._observe_served(pool, 0, now)
        request = QueuedRequest(
            id=request_id,
            tenant=tenant,
            tier=tier,
            endpoint=endpoint,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            sequences=sequences,
            estimated_output_tokens=self.estimator.estimate(
                tenant, endpoint, max_tokens, sequences, self.request_model(model)),
            arrival_s=now,
            user=user,
            session=session,
            program=program,
            model=self.request_model(model),
            priority=priority,
            deadline_s=deadline_s,
            prefix=prefix,
            cost_factor=(1.0 if self.service_cost is None else self.service_cost.factor(
                endpoint, self.request_model(model), prompt_tokens)),
        )
        if admitted is None:
            admitted = self.rate_limiter.admit(tenant, endpoint, request.estimated_tokens, now,
                                               tier, request.model)
        else:
            request.shared_limits = True
        if not isinstance(admitted, Admit):
            self.ledger.end(request_id, Outcome.REJECTED, admitted.reason)
            return admitted
        request.admitted_tokens = admitted.tokens
        if prefix is not None:
            # The backlog and early rejection count what the engine computes: the most any
            # backend of the pool holds (where prefix_aware sends it); dispatch re-predicts.
            request.predicted_cached_tokens = max(
                self.fleet[name].predicted_cached(request) for name in backends)
        scheduler = pool.scheduler
        service_s = (decode_s(request, (self.fleet[name].gate.decode_tokens_per_s_per_seq
                                        for name in backends))
                     if deadline_covers_output else 0.0)
        if scheduler.holds_requests and pool.predictor.deadline_unmeetable(request, now,
                                                                           service_s):
            wait = pool.predictor.predicted_wait_s(request)
            return self._turn_away(
                request,
                Reject(DEADLINE_UNMEETABLE, wait, f"predicted wait {wait or 0:.3f}s"),
                now,
            )
        rejected = scheduler.enqueue(request, now)
        if rejected is not None:
            return self._turn_away(request, rejected, now)
        self._pool_of[request_id] = pool
        if scheduler.tenant_queued(tenant)[0] == 1:
            pool.light[tenant] = now  # arrived to an empty queue: light until backlogged
        return request

    def _turn_away(self, request: QueuedRequest, reject: Reject, now: float) -> Reject:
        self._refund(request, now)
        self.ledger.end(request.id, Outcome.REJECTED, reject.reason)
        return reject

    def _refund(self, request: QueuedRequest, now: float) -> None:
        """Its token charge back (ratelimit's refund policy), to whichever limits took it."""
        if request.shared_limits:
            if request.admitted_tokens:
                self._record.charges.append((request, -request.admitted_tokens))
        else:
            self.rate_limiter.refund(request.tenant, request.endpoint, request.admitted_tokens,
                                     now, request.tier, request.model)

    def _settle(self, request: QueuedRequest, actual: int, now: float) -> None:
        if request.shared_limits:
            if actual != request.admitted_tokens:
                self._record.charges.append((request, actual - request.admitted_tokens))
        else:
            self.rate_limiter.settle(request.tenant, request.endpoint, request.admitted_tokens,
                                     actual, now, request.tier, request.model)

    @_entry
    def cancel(self, request_id: str, now: float) -> bool:
        """The client of a *queued* request went away: it leaves at once. False if it is not
        queued (then it is in flight: abort upstream and call ``on_client_gone``)."""
        pool = self._pool_of.get(request_id)
        request = None if pool is None else pool.scheduler.cancel(request_id)
        if request is None:
            return False
        del self._pool_of[request_id]
        self._refund(request, now)
        self.ledger.end(request_id, Outcome.CANCELLED)
        return True

    # ------------------------------------------------------------------ egress

    @_entry
    def share_slots(self, now: float, backends: frozenset[str] | None = None) -> int:
        """In-flight slots that weighted shares are computed over: the healthy backends'
        caps without their headroom (of a pool's backends; by default, all)."""
        return share_slots(self.fleet, now, backends)

    @_entry
    def next_dispatch(self, now: float) -> Dispatch | None:
        """One dispatch decision (request and backend together), or None: nothing queued, or
        no backend may take anything now (counted in ``holds``). Pools with requests
        queued take turns, so one pool's backlog never delays another's dispatch."""
        pools = [pool for pool in self._pools.values() if pool.scheduler.queued_requests]
        if not pools:
            return None
        decision = self._cycle.next(pools, now)
        if decision is None:
            return None
        return self._dispatch(decision.pool, decision.request, decision.backend, now,
                              decision.slots)

    def dispatch_ready(self, now: float) -> Iterator[Dispatch]:
        """Every dispatch possible now (the selector chain repeated until a gate closes or
        the queue empties)."""
        while (dispatch := self.next_dispatch(now)) is not None:
            yield dispatch

    def _dispatch(
        self, pool: Pool, request: QueuedRequest, backend: str, now: float, slots: int
    ) -> Dispatch:
        request.backend = backend
        record = self.fleet[backend]
        record.gate.on_dispatched(now)
        request.inflight_at_dispatch = record.inflight
        index = record.prefix
        # What the engine's prefix-cache lookups will count of it (sidecar.prefix.CacheShare):
        # each of its n answers is an engine request.
        self._count_sent(backend, request.prompt_tokens * request.sequences)
        if request.prefix is not None:
            request.predicted_cached_tokens = record.predicted_cached(request)
            index.sent(request.prefix)
            if self._record.sharing and index.retained_blocks:
                self._record.sent_prefixes.append((backend, index.block_size,
                                                   request.prefix.blocks(index.block_size)))
        # Its expected output as the KV footprint and the routing load count it: what the
        # tenant's recent answers ended at (decision 0018), the estimate before any is seen.
        expected = self._final_output(request, 0)
        if expected is None:
            expected = request.estimated_output_tokens
        # The routing load counts what the engine computes: the cached prompt is free.
        self.fleet.dispatched(
            request.id, record, request.prompt_tokens - request.predicted_cached_tokens,
            expected
        )
        self.route.dispatched(request, record, self.fleet)
        if self._record.sharing and request.session is not None:
            self._record.sent_sessions.append((request.tenant, request.session, backend))
        self.ledger.dispatch(request.id)
        record.kv.add(request.id, request.tenant, request.prompt_tokens, expected,
                      record.shared_blocks(request), request.sequences)
        self._reported[request.id] = 0
        # Pacing counts what the engine prefills: a cached prompt costs it nothing.
        if request.computed_prompt_tokens > 0:
            record.prefilling[request.tenant] += request.computed_prompt_tokens
        scheduler = pool.scheduler
        scheduler.discount_cached(request)
        if scheduler.tenant_queued(request.tenant)[0] == 0:
            pool.light[request.tenant] = now
        else:
            pool.light.pop(request.tenant, None)  # backlogged upstream: not light
        # Judged with the tenants active lately (light), so a flood that had the engine to
        # itself between a light tenant's requests is still demoted below it.
        over = scheduler.uses_headroom and scheduler.over_share(
            request.tenant, slots, light_tenants(pool, now))
        priority = None
        if record.priority_scheduling:
            priority = vllm_priority(self._tier_priority[request.tier], over, self._demotion)
        return Dispatch(request, backend, priority, over)

    @_entry
    def dispatch_failed(self, request: QueuedRequest, now: float) -> None:
        """The backend never received the request (connection refused, reset before the
        request was written): it goes back to its place in the queue, its charges refunded.
        Mark the backend unhealthy first if it is down, or the retry may pick it again."""
        if request.state is not RequestState.DISPATCHED:
            raise ValueError(f"request {request.id!r} is {request.state.value}, not dispatched")
        assert request.backend is not None
        self._count_sent(request.backend, -request.prompt_tokens * request.sequences)
        self._release_backend(request, now)
        self._pool_of[request.id].scheduler.requeue(request)
        self.ledger.requeue(request.id)

    # ------------------------------------------------------------------ in flight

    def on_first_token(self, request: QueuedRequest, now: float) -> None:
        self.on_tokens_streamed(request, 0, now)

    def on_tokens_streamed(self, request: QueuedRequest, tokens: int, now: float) -> None:
        if request.state is not RequestState.DISPATCHED:
            return
        if tokens > 0 and request.id in self._prefilled:
            # Past its first token: counted now, folded in at the next decision (module
            # doc, "Streamed tokens").
            request.streamed_output_tokens += tokens
            request.unfolded_tokens += tokens
            request.unfolded_s = now
            self._unfolded[request.id] = request
            return
        pool = self._pool_of[request.id]
        pool.scheduler.on_tokens_streamed(request, tokens)
        assert request.backend is not None
        record = self.fleet[request.backend]
        self._grown(request, record, tokens)
        served = max(0, tokens)
        if request.id not in self._prefilled:
            self._prefilled.add(request.id)  # the first token says the prompt was served
            self._admitted(request, now)
            served += request.computed_prompt_tokens  # the meter counts what DRR charges
            self._end_prefill(request)
            record.gate.on_first_token(now)
        self._reported[request.id] += served
        self._observe_served(pool, served, now)

    def _fold_streamed(self) -> None:
        """Fold every in-flight request's unfolded output into the scheduler's charge, the
        route's outstanding tokens, the KV footprint and the throughput meter (at the time
        its last token passed): what ``on_tokens_streamed`` would have done token by token."""
        unfolded = self._unfolded
        if not unfolded:
            return
        for request in unfolded.values():
            self._fold(request)
        unfolded.clear()

    def _fold(self, request: QueuedRequest) -> None:
        tokens, request.unfolded_tokens = request.unfolded_tokens, 0
        if not tokens or request.state is not RequestState.DISPATCHED:
            return
        pool = self._pool_of[request.id]
        pool.scheduler.charge_streamed(request)
        assert request.backend is not None
        self._grown(request, self.fleet[request.backend], tokens)
        self._reported[request.id] += tokens
        self._observe_served(pool, tokens, request.unfolded_s)

    def _grown(self, request: QueuedRequest, record: Backend, tokens: int) -> None:
        """``tokens`` more of its output streamed (``streamed_output_tokens`` counts them):
        the routing load and the KV footprint count it at its expected final length now."""
        fleet = self.fleet
        fleet.streamed(request.id, tokens)
        if tokens <= 0:
            record.kv.on_tokens(request.id, tokens)
            return
        generated = request.streamed_output_tokens
        final = self._final_output(request, generated)
        if final is not None:
            fleet.expect(request.id, final - generated)
        record.kv.on_tokens(request.id, tokens, final)

    def _final_output(self, request: QueuedRequest, generated: int) -> int | None:
        """Every sequence's expected final output once the request has generated
        ``generated`` tokens over all of them (``OutputEstimator.final``, per sequence);
        None before its tenant's answers on its endpoint and model are seen."""
        n = max(1, request.sequences)
        per_sequence = self.estimator.final(request.tenant, request.endpoint, generated // n,
                                            request.max_tokens, request.model)
        return None if per_sequence is None else max(generated, per_sequence * n)

    @_entry
    def on_completed(
        self, request: QueuedRequest, prompt_tokens: int, output_tokens: int, now: float,
        cached_tokens: int | None = None,
    ) -> None:
        """Every end is an entry, folding every stream, not only this one: the end changes the
        scheduler's state (a tenant going idle forfeits its credit) that a later charge would
        meet. ``cached_tokens``: what the engine reported it found in its prefix cache
        (``usage.prompt_tokens_details.cached_tokens``); None: not reported."""
        record = None if request.backend is None else self.fleet[request.backend]
        if record is not None and prompt_tokens != request.prompt_tokens \
                and request.state is RequestState.DISPATCHED:
            # The engine's own count of the prompt replaces the estimate sent with it.
            corrected = (prompt_tokens - request.prompt_tokens) * request.sequences
            record.prefix.cache_share.admitted(corrected, now, pending=0)
            if self._record.sharing:
                self._record.sent_tokens[record.name] += corrected
        if cached_tokens is None and request.prefix is not None \
                and record is not None and not record.unreported:
            # Predictions no answer can settle: off for this backend, the full charge back.
            record.unreported = True
            record.prefix.resize(0, record.prefix.block_size)
        if cached_tokens is not None and request.prefix is not None and record is not None:
            record.reporting = True
            key = (request.tenant, record.name)
            self.cached_predicted[key] += request.predicted_cached_tokens
            self.cached_reported[key] += cached_tokens
            # The engine's prompt count teaches the index its bytes per token for text.
            record.prefix.settle(request.prefix, request.predicted_cached_tokens, cached_tokens,
                                 prompt_tokens)
        if self.service_cost is not None and record is not None \
                and request.dispatched_s is not None:
            # Its share of the engine's time while it ran: our requests there at its
            # dispatch and now, itself included, share it.
            sharing = (request.inflight_at_dispatch + record.inflight) / 2
            self.service_cost.observe(
                request.endpoint, request.model, prompt_tokens,
                prompt_tokens - min(cached_tokens or 0, prompt_tokens) + output_tokens,
                (now - request.dispatched_s) / max(1.0, sharing))
        # Unreported, nothing is known cached: the whole prompt is charged.
        self._end(request, Outcome.COMPLETED, prompt_tokens, output_tokens, now,
                  cached_tokens or 0)
        # The estimate is per sequence: a request of n answers reports all n's tokens.
        self.estimator.observe(request.tenant, request.endpoint,
                               round(output_tokens / request.sequences), request.model)

    @_entry
    def on_failed(
        self, request: QueuedRequest, prompt_tokens: int, output_tokens: int, now: float
    ) -> None:
        """A backend error ended the request. Pass what it consumed (0, 0 if nothing is
        known): DRR and rate limits are settled to that, so failures are not charged."""
        self._end(request, Outcome.FAILED, prompt_tokens, output_tokens, now)

    @_entry
    def on_client_gone(
        self, request: QueuedRequest, prompt_tokens: int, output_tokens: int, now: float
    ) -> None:
        """The client went away: queued -> cancelled at once; streaming -> call after
        aborting the backend request, with what was produced so far."""
        self._end(request, Outcome.CANCELLED, prompt_tokens, output_tokens, now)

    def _end(
        self,
        request: QueuedRequest,
        outcome: Outcome,
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        cached_tokens: int | None = None,
    ) -> None:
        """``cached_tokens``: the prompt tokens the engine found cached (default: as
        predicted at dispatch); the DRR charge settles to the tokens it computed, the rate
        limits to every token but the weight's discount on those the engine reported."""
        if request.state is RequestState.QUEUED:
            # Ended before dispatch (client gone, shutdown): leaves the queue, refunded.
            self.ledger.end(request.id, outcome)  # raises on a second end, before any change
            self._pool_of.pop(request.id).scheduler.cancel(request.id)
            self._refund(request, now)
            return
        self.ledger.end(request.id, outcome)  # raises on a second end, before any change
        if request.id not in self._prefilled:
            self._admitted(request, now)
        pool = self._pool_of.pop(request.id)
        cached = request.predicted_cached_tokens if cached_tokens is None else cached_tokens
        computed = prompt_tokens - max(0, min(cached, prompt_tokens - 1))
        pool.scheduler.on_finished(request, computed, output_tokens)
        # Rate limits discount only what the engine reported cached, by the contract's weight.
        self._settle(request, limited_tokens(prompt_tokens, output_tokens, cached_tokens or 0,
                                             self._cached_weight(request)), now)
        reported = self._release_backend(request, now)
        self._observe_served(pool, max(0, computed + output_tokens - reported), now)

    def _cached_weight(self, request: QueuedRequest) -> float:
        """What a cached prompt token counts in the request's rate limits: its tier's
        ``cached_prompt_token_weight``, else its endpoint's (1 when neither says)."""
        weight = self.config.tiers[request.tier].cached_prompt_token_weight
        if weight is None:
            endpoint = self.config.endpoints.get(request.endpoint)
            weight = 1.0 if endpoint is None else endpoint.cached_prompt_token_weight
        return weight

    def _count_sent(self, backend: str, tokens: int) -> None:
        self.fleet[backend].prefix.cache_share.sent(tokens)
        if self._record.sharing:
            self._record.sent_tokens[backend] += tokens

    def _admitted(self, request: QueuedRequest, now: float) -> None:
        """The engine has admitted the request by ``now`` (its first token, or its end: an
        end without one errs toward the sidecar's share), and counted its lookup."""
        assert request.backend is not None
        self.fleet[request.backend].prefix.cache_share.admitted(
            request.prompt_tokens * request.sequences, now)

    def _release_backend(self, request: QueuedRequest, now: float) -> int:
        assert request.backend is not None
        record = self.fleet[request.backend]
        prefilled = request.id in self._prefilled
        record.gate.on_finished(now, awaiting_first_token=not prefilled)
        self.fleet.finished(request.id)
        record.kv.remove(request.id)
        if prefilled:
            self._prefilled.discard(request.id)
        else:
            self._end_prefill(request)
        if record.draining:
            self.fleet.forget_if_drained(record.name)
        return self._reported.pop(request.id, 0)

    def _end_prefill(self, request: QueuedRequest) -> None:
        assert request.backend is not None
        self.fleet[request.backend].prefilled(request.tenant, request.computed_prompt_tokens)

    @staticmethod
    def _observe_served(pool: Pool, tokens: int, now: float) -> None:
        pool.meter.observe(tokens, now, saturated=pool.scheduler.queued_requests > 0)

    # ------------------------------------------------------------------ backends

    @_entry
    def on_backend_metrics(self, backend: str, sample: BackendSample) -> None:
        record = self.fleet.get(backend)
        if record is not None:  # else drained and forgotten since the scrape was sent
            record.observe(sample)

    def poll_period_s(self, backend: str | None = None) -> float:
        """How often to scrape ``backend`` (derived from its step time unless configured);
        without a backend, the shortest over all of them (the dispatch tick)."""
        if backend is not None and backend in self.fleet:
            return self.fleet[backend].gate.limits.poll_s
        return min(b.gate.limits.poll_s for b in self.fleet)

    @_entry
    def mark_backend_unhealthy(self, backend: str) -> None:
        if backend in self.fleet:
            self.fleet[backend].healthy = False

    @_entry
    def mark_backend_healthy(self, backend: str) -> None:
        if backend in self.fleet:
            self.fleet[backend].healthy = True

    # ------------------------------------------------------------------ admin

    def estimated_tokens(self, tenant: str, endpoint: str, prompt_tokens: int,
                         max_tokens: int | None, sequences: int = 1,
                         model: str | None = None) -> int:
        """A request's expected tokens (prompt + estimated output): what ``arrive`` charges
        the rate limits, what a shared limiter must take for it, and what the stability
        ratio counts as offered load. ``model``: the body's (``request_model`` resolves
        none to the default, as ``arrive`` does)."""
        return prompt_tokens + self.estimator.estimate(tenant, endpoint, max_tokens, sequences,
                                                       self.request_model(model or None))

    @_entry
    def stats(self, now: float) -> CoreStats:
        """Per tenant, summed over the pools (one pool: its own figures)."""
        schedulers = [pool.scheduler for pool in self._pools.values()]
        tenants = tuple(
            TenantStats(name, spec.tier, spec.weight,
                        sum(s.tenant_queued(name)[1] for s in schedulers),
                        sum(s.deficit(spec.tier, name) for s in schedulers),
                        sum(s.forfeited(spec.tier, name) for s in schedulers))
            for name, spec in self.config.tenants.items())
        backends = tuple(
            BackendStats(b.name, b.takes_work, b.inflight, b.outstanding_tokens,
                         b.prefill_tokens, b.gate.cap(now), b.gate.decode_tokens_per_s_per_seq,
                         learned_step_s(b.gate), len(b.prefix), b.prefix.share)
            for b in self.fleet)
        tallies = {key: replace(tally, rejected=Counter(tally.rejected))
                   for key, tally in self.ledger.tallies().items()}
        rates = [rate for pool in self._pools.values()
                 if (rate := pool.meter.tokens_per_s) is not None]
        return CoreStats(tallies, tenants, dict(self.holds), sum(rates) if rates else None,
                         backends, self.ledger.by_model(),
                         {name: served for name in self.fleet.names
                          if (served := self.catalog.models_of(name)) is not None},
                         dict(self.cached_predicted), dict(self.cached_reported),
                         dict(self.routing_decisions), current_pools(self.catalog),
                         step_budget(self.config.admission))

    @_entry
    def snapshot(self, now: float, max_tenants: int | None = 100) -> dict[str, Any]:
        """Everything /admin/state shows, as plain dicts."""
        models = self.catalog.models()
        rates = [rate for pool in self._pools.values()
                 if (rate := pool.meter.tokens_per_s) is not None]
        return {
            # The pool of every backend (module doc of sidecar.catalog); "pools" has each.
            "scheduler": self.scheduler.snapshot(max_tenants),
            "pools": [
                {"backends": sorted(pool.backends),
                 "models": sorted(m for m, backends in models.items()
                                  if backends == pool.backends),
                 "throughput_tokens_per_s": pool.meter.tokens_per_s,
                 "scheduler": pool.scheduler.snapshot(max_tenants)}
                for pool in self._pools.values()],
            "rate_limits": self.rate_limiter.snapshot(now),
            "backends": {b.name: b.snapshot(now) for b in self.fleet},
            "throughput_tokens_per_s": sum(rates) if rates else None,
            "ledger": self.ledger.snapshot(),
            # scheduler.service_cost's factor per (endpoint, model, band); None: off.
            "service_cost": None if self.service_cost is None else self.service_cost.snapshot(),
        }
