"""This process as one replica among several: what its scheduling core tells the others, and
what it takes from them (docs/sidecar.md, "Several replicas").

:class:`Replica` wraps a ``SchedulingCore`` for ``sidecar.shared``, which carries what it
gives and takes through Redis; the core's own surface stays about scheduling. The wrapper
reaches the core only through :class:`ReplicatedCore`: its limits and estimator, its pools
(each pool's backends, queues and the others' load on it), the record the core keeps for
replicas, and its prefix indexes' ``learn_sent_prefix`` and ``learn_sent_tokens``.
Everything here is pure: no clock, no I/O.

Pools are named across replicas by their backends (``pool_id``): replicas configured alike
form the same pools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from weighbridge.sidecar.core import ReplicaRecord
from weighbridge.sidecar.estimator import Observation, OutputEstimator
from weighbridge.sidecar.ratelimit import (
    BucketSettings,
    BucketSpec,
    LimitTable,
    ScopeKey,
    StoredLevel,
    TenantRateLimiter,
)
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import Scheduler

__all__ = ["SERVICE_SYNC_S", "Replica", "ReplicaPool", "ReplicatedCore", "pool_id"]

# How often service, estimates and settlements are exchanged (load: every sync_ms).
SERVICE_SYNC_S = 0.03

# (pool, tenant) -> (requests in flight, backlogged): one replica's load, or the others' summed.
Load = dict[tuple[str, str], tuple[int, bool]]


class ReplicaPool(Protocol):
    """One pool as replication sees it."""

    backends: frozenset[str]
    scheduler: Scheduler
    # Other replicas' load on the pool's backends, by tenant: (in flight, backlogged).
    foreign: dict[str, tuple[int, bool]]


class ReplicatedCore(Protocol):
    """What :class:`Replica` uses of the scheduling core (``SchedulingCore`` is one)."""

    limit_table: LimitTable
    rate_limiter: TenantRateLimiter
    estimator: OutputEstimator

    def request_model(self, model: str | None) -> str | None: ...

    def record_for_replicas(self) -> ReplicaRecord: ...

    def pools(self) -> Sequence[ReplicaPool]: ...

    def learn_sent_prefix(self, backend: str, block_size: int,
                          blocks: Sequence[int]) -> None: ...

    def learn_sent_tokens(self, backend: str, tokens: int, now: float) -> None: ...

    def learn_session(self, tenant: str, session: str, backend: str, now: float) -> None: ...


def pool_id(backends: frozenset[str]) -> str:
    """A pool's name in what replicas exchange: its backends, sorted."""
    return ",".join(sorted(backends))


class Replica:
    def __init__(self, core: ReplicatedCore) -> None:
        """From here on the core records what the others need (``record_for_replicas``)."""
        self._core = core
        self._record = core.record_for_replicas()
        # What replaced limiters had charged and nobody took yet.
        self._charged: dict[tuple[ScopeKey, str], float] = {}

    # ------------------------------------------------------------------ limits

    def buckets(self, tenant: str, endpoint: str, tier: str,
                model: str | None) -> list[BucketSpec]:
        """The buckets a request draws on, as the shared limits name them."""
        core = self._core
        return core.limit_table.buckets(tenant, endpoint, tier, core.request_model(model))

    @property
    def limit_table(self) -> LimitTable:
        return self._core.limit_table

    def use_local_limits(self, scale: float,
                         levels: Mapping[tuple[ScopeKey, str], StoredLevel],
                         wall_offset_s: float) -> None:
        """Replace the core's limiter by one whose every limit is ``scale`` of the configured
        (this replica's share while the shared limits are out of reach), each bucket at
        ``scale`` of its level in ``levels`` (the shared ones as last read, at wall-clock
        times ``now + wall_offset_s``), a day or month bucket not there empty. It keeps a
        ledger of what it charges (``take_local_charges``)."""
        core = self._core
        self._take_charged(core.rate_limiter)
        core.rate_limiter = TenantRateLimiter(
            core.limit_table, settings=BucketSettings(
                scale=scale, wall_offset_s=wall_offset_s, restored=dict(levels),
                unseen_long_empty=True), ledger=True)

    def _take_charged(self, limiter: TenantRateLimiter) -> None:
        for bucket, amount in limiter.take_charged().items():
            self._charged[bucket] = self._charged.get(bucket, 0.0) + amount

    def take_local_charges(self) -> dict[tuple[ScopeKey, str], float]:
        """The net amount this replica's own limiters charged each bucket since the last
        call (an outage's admissions and settlements): owed to the shared buckets."""
        self._take_charged(self._core.rate_limiter)
        taken, self._charged = self._charged, {}
        return taken

    def take_charges(self) -> list[tuple[QueuedRequest, int]]:
        """Settlements and refunds owed to the shared limits since the last call: (request,
        token delta), positive a further charge, negative a refund."""
        record = self._record
        taken, record.charges = record.charges, []
        return taken

    # ------------------------------------------------------------------ service and load

    def take_booked(self) -> dict[tuple[str, str, str], float]:
        """Service charged per (pool, tier, tenant) since the last call, in the fairness
        policy's own unit (DRR's turns; every replica runs the same policy)."""
        return {(pool_id(pool.backends), tier, tenant): turns
                for pool in self._core.pools()
                for (tier, tenant), turns in pool.scheduler.take_booked().items()}

    def queued_flows(self) -> list[tuple[str, str, str]]:
        """(pool, tier, tenant) of every tenant queue with requests waiting here: whose
        service elsewhere this replica needs to know to order its queues."""
        return [(pool_id(pool.backends), tier, tenant) for pool in self._core.pools()
                for tier, tenant in pool.scheduler.queued_flows()]

    def charge_foreign(self, pool: str, tier: str, tenant: str, turns: float) -> None:
        """Service other replicas gave ``tenant`` on ``pool``'s backends, charged here (a
        pool or tenant queue this replica does not have: nothing)."""
        for candidate in self._core.pools():
            if pool_id(candidate.backends) == pool:
                candidate.scheduler.charge_foreign(tier, tenant, turns)

    def local_load(self) -> Load:
        """(pool, tenant) -> (requests in flight, any queued) here: what the others need
        for their ``set_foreign_load``."""
        out: Load = {}
        for pool in self._core.pools():
            pid = pool_id(pool.backends)
            for name, (inflight, queued) in pool.scheduler.active_load().items():
                out[(pid, name)] = (inflight, queued > 0)
        return out

    def set_foreign_load(self, load: Load) -> None:
        """Every other replica's load, summed: (pool, tenant) -> (in flight, backlogged on
        any of them). Replaces the previous; the core's dispatch judges global shares by it."""
        by_pool: dict[str, dict[str, tuple[int, bool]]] = {}
        for (pid, tenant), value in load.items():
            by_pool.setdefault(pid, {})[tenant] = value
        for pool in self._core.pools():
            pool.foreign = by_pool.get(pool_id(pool.backends), {})

    # ------------------------------------------------------------------ estimates

    @property
    def estimate_alpha(self) -> float:
        """The smoothing every replica folds observations with, in the same order."""
        return self._core.estimator.alpha

    def take_observations(self) -> list[Observation]:
        """(tenant, endpoint, model, output tokens) of every request completed since the last
        call (model "" for a request naming none where there is no default)."""
        return self._core.estimator.take_observations()

    def adopt_estimate(self, tenant: str, endpoint: str, ema: float,
                       model: str | None = None) -> None:
        """The output estimate the replicas agree on for (tenant, endpoint, model)."""
        self._core.estimator.adopt(tenant, endpoint, ema, model)

    def learn_outputs(self, observations: Sequence[Observation]) -> None:
        """Other replicas' completed outputs, into this one's history of recent outputs
        (what an answer's expected final length is read from: decision 0018)."""
        estimator = self._core.estimator
        for tenant, endpoint, model, tokens in observations:
            estimator.learn(tenant, endpoint, model, tokens)

    # ------------------------------------------------------------------ prompts

    def take_sent_prefixes(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """(backend, block size, the prompt's chained block hashes) of every prompt this
        replica sent since the last call."""
        record = self._record
        taken, record.sent_prefixes = record.sent_prefixes, []
        return taken

    def learn_sent_prefix(self, backend: str, block_size: int, blocks: Sequence[int]) -> None:
        """Another replica sent a prompt of these blocks to ``backend``: this replica's index
        holds them as if sent from here (an unknown backend or another block size: nothing)."""
        self._core.learn_sent_prefix(backend, block_size, blocks)

    def take_sent_tokens(self) -> dict[str, int]:
        """Prompt tokens (times answers) this replica sent each backend since the last call
        (net of dispatches that never reached it, and of the engines' own prompt counts)."""
        record = self._record
        taken = {backend: n for backend, n in record.sent_tokens.items() if n}
        record.sent_tokens.clear()
        return taken

    def take_sent_sessions(self) -> list[tuple[str, str, str]]:
        """(tenant, session, backend) of every request naming a session this replica sent
        since the last call."""
        record = self._record
        taken, record.sent_sessions = record.sent_sessions, []
        return taken

    def learn_session(self, tenant: str, session: str, backend: str, now: float) -> None:
        """Another replica sent ``tenant``'s ``session`` to ``backend``, told at ``now``."""
        self._core.learn_session(tenant, session, backend, now)

    def learn_sent_tokens(self, backend: str, tokens: int, now: float) -> None:
        """Another replica sent ``backend`` prompts of ``tokens`` tokens, told at ``now``: the
        engine's prefix-cache lookups count them with this replica's (sidecar.prefix)."""
        self._core.learn_sent_tokens(backend, tokens, now)
