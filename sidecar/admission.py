"""When a backend may take one more request: the admission gate between queue and backend.

Fed with the backend's scraped vLLM metrics and with the sidecar's own dispatches and
completions, one ``AdmissionGate`` per backend answers ``verdict(now)``:

``open``      any tenant may dispatch;
``headroom``  only tenants under their weighted share of in-flight slots may (see below);
``closed``    nobody, with the reason (for the holds counter).

Rules, in order:

1. In-flight cap. With fresh metrics the cap is ``max_running`` (a concurrency target at or
   below the engine's ``max_num_seqs``; defaults to ``max_inflight``); with stale or missing
   metrics it is the conservative fallback ``max_inflight``. There is always a cap, never
   "unlimited".
2. Fresh metrics only, and only while the sidecar has something in flight on the backend
   (with nothing of ours in flight, we dispatch one regardless, so the gate can never block
   forever on a backend that other clients keep busy or whose counters we misread):
   - estimated backend waiting > ``max_backend_waiting`` -> closed (``backend_waiting``);
   - per-sequence decode speed < ``min_decode_tokens_per_s`` -> closed (``decode_slow``).
3. Headroom: at ``cap - headroom_slots`` in flight and above, only under-share tenants.

Estimated waiting between scrapes is ``waiting + dispatched_since - finished_since - free``
(at least 0), where ``free`` are the running slots the scrape showed unused (``cap -
running`` when nothing was waiting, else 0): our dispatches since the scrape fill free slots
first, then queue; each completion since lets one waiting request run. So a stale-but-valid
scrape neither stalls dispatch (free slots are used at once) nor lets a herd through (every
dispatch counts until the next scrape says where it went).

The estimate is capped by ``foreign + awaiting``: a request waiting in the engine has not
been prefilled, so of ours at most ``awaiting`` (in flight there, no first token yet) can be
waiting now, and ``foreign = max(0, scraped waiting - awaiting at the scrape)`` is what other
clients certainly had waiting then (held constant until the next scrape). Without the cap, a
scrape that caught a momentary queue of ours (a few arrivals just before a step boundary, gone
one step later) kept the gate closed until enough *completions* came back, which at 200
requests/s added ~100 ms to the p99 TTFT (benchmarks/sidecar_overhead.py); with it, our first
tokens reopen the gate at once, while another client's queue still holds it.

Why headroom. vLLM preempts running sequences only when KV blocks run out, never to admit a
waiting request. Once one tenant's flood fills every running slot, a well-behaved tenant's
request waits for a slot turnover however fair the upstream queue is. Keeping
``headroom_slots`` of the cap for tenants under their share means their requests start at
once; the cost is that a lone heavy tenant can use only ``cap - headroom_slots`` slots.
``vllm_priority`` complements it on backends with ``--scheduling-policy priority``: over-share
requests are sent with a demoted priority so the engine preempts them first under KV
pressure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from weighbridge.sidecar.shape import EngineShape, ShapeLearner
from weighbridge.vllm_metrics import BackendSample

if TYPE_CHECKING:
    from weighbridge.sidecar.config import Admission

GateMode = Literal["open", "headroom", "closed"]


@dataclass(frozen=True, slots=True)
class GateVerdict:
    mode: GateMode
    reason: str = ""  # why it is not open: headroom, inflight_cap, fallback_cap, ...
    share_slots: int = 0  # the cap in force without the headroom (see share_slots())


@dataclass(frozen=True, slots=True)
class GateLimits:
    max_backend_waiting: int = 2
    min_decode_tokens_per_s: float = 7.0
    metrics_stale_s: float = 1.0
    max_inflight: int = 64  # the fallback cap (stale or missing metrics)
    max_running: int | None = None  # the cap with fresh metrics; None: max_inflight
    headroom_slots: int = 0
    # False: the headroom is kept only while a light tenant (one that was not backlogged
    # upstream when it last dispatched) has been around lately; with only backlogged
    # tenants, it is ordinary capacity (sidecar.core: work-conserving headroom).
    headroom_always: bool = True
    # KV-aware admission (sidecar.core): the engine's cache in blocks (None: off), tokens per
    # block, and the blocks above the watermark that only under-share tenants may fill.
    kv_blocks: int | None = None
    block_size: int = 16
    kv_reserve_blocks: int = 0
    # Prompt tokens still prefilling (dispatched, no first token) one tenant may have before
    # its next dispatch, and the backend before it takes more; None: no limit.
    max_prefill_tokens_inflight: int | None = None
    max_backend_prefill_tokens: int | None = None
    poll_s: float = 0.25  # how often the backend's /metrics is scraped

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or (self.max_running is not None and self.max_running < 1):
            raise ValueError("caps must be at least 1")
        smallest = min(self.max_inflight, self.max_running or self.max_inflight)
        if not 0 <= self.headroom_slots < smallest:
            # headroom == cap would leave no slot for a lone over-share tenant: blocked forever.
            raise ValueError(f"headroom_slots must be in [0, {smallest}), got "
                             f"{self.headroom_slots}")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.kv_blocks is not None and not 0 <= self.kv_reserve_blocks < self.kv_blocks:
            raise ValueError(f"kv_reserve_blocks must be in [0, {self.kv_blocks}), got "
                             f"{self.kv_reserve_blocks}")
        if not self.poll_s > 0:
            raise ValueError("poll_s must be positive")

    @property
    def kv_watermark(self) -> int | None:
        """KV blocks an over-share tenant's dispatches may bring our footprint up to."""
        return None if self.kv_blocks is None else self.kv_blocks - self.kv_reserve_blocks

    @classmethod
    def from_config(cls, admission: Admission, tenant_aware: bool = True) -> GateLimits:
        """The limits for an engine of unknown shape (nothing learned yet)."""
        return derive_limits(admission, EngineShape(), tenant_aware)


# Defaults derived from the engine's shape (docs/sidecar.md#admission-defaults).
WAITING_UNKNOWN_SLOTS = 8  # the waiting bound before slots are known (200 req/s on ~12 ms
# steps is ~2.4 arrivals a step with a Poisson tail of 6-8: benchmarks/sidecar_overhead.py)
DEFAULT_STEP_BUDGET = 2048  # vLLM's default --max-num-batched-tokens for serving
DEFAULT_POLL_S = 0.1  # before a step time is measured
POLL_STEPS = 8  # scrape about every 8 engine steps...
POLL_BOUNDS_S = (0.05, 0.25)  # ...within these bounds
# ... and at least this many scrape durations apart, up to POLL_COST_CAP_S: the engine's API
# server renders /metrics on the event loop that streams tokens, so scrapes take at most
# about 2% of its time; scraped more often, real vLLM CPU under a flood loses output
# (benchmarks/RESULTS.md, "isolation").
POLL_SCRAPE_MULTIPLE = 50
POLL_COST_CAP_S = 0.5  # a poll this long is still twice as fresh as metrics_stale_ms (1 s)


def reserve_fraction(slots: int | None) -> float:
    """The share of an engine kept for under-share tenants: max(1, slots/8) of its slots (one
    slot of eight; at least one), and the same fraction of its KV cache."""
    if slots is None:
        return 1 / 8
    return max(1, slots // 8) / slots


def derive_limits(admission: Admission, shape: EngineShape,
                  tenant_aware: bool = True) -> GateLimits:
    """Every admission limit for one backend: the config's value where given, else derived
    from what was learned of the engine (``shape``). The fairness settings (headroom, KV
    reserve, prefill pacing and backlog) are derived only for ``tenant_aware`` policies: the
    FIFO baselines get what the config sets and nothing more.

    slots S (config ``max_running_per_backend``, else learned) and the waiting bound W
    (config, else max(2, S/8), or 8 while S is unknown) give the fresh cap S + W when S was
    learned (the engine runs S, W wait in its queue, so batches stay full) and headroom so
    that a lone tenant holds at most S - max(1, S/8) in flight: the rest are running slots
    a well-behaved tenant finds free. While a learned S is only a lower bound
    (``shape.slots_exact`` False), a lone tenant may hold S + W/2 instead: the probe by
    which a larger engine's slots are learned. The KV reserve is the same fraction of the
    cache.
    """
    slots = admission.max_running_per_backend or shape.slots
    waiting = _waiting_bound(admission, slots)
    max_running = _running_cap(admission, shape, waiting)
    fresh_cap = max_running or admission.max_inflight_per_backend
    smallest = min(fresh_cap, admission.max_inflight_per_backend)
    headroom = _headroom(admission, shape, slots, waiting, fresh_cap, tenant_aware)
    headroom = max(0, min(headroom, smallest - 1))

    kv_blocks = admission.kv_cache_blocks or shape.kv_blocks
    block_size = admission.kv_block_size or shape.block_size or 16
    kv_on = admission.kv_aware and tenant_aware and kv_blocks is not None
    reserve = _kv_reserve(admission, kv_blocks, slots) if kv_on else 0

    budget = admission.step_budget_tokens or DEFAULT_STEP_BUDGET

    def prefill_limit(configured: int | None, budgets: int) -> int | None:
        if configured is not None:
            return configured or None  # 0: no limit
        return budget * budgets if tenant_aware else None

    poll = _poll_s(admission, shape)
    return GateLimits(
        max_backend_waiting=waiting,
        min_decode_tokens_per_s=admission.min_decode_tokens_per_s,
        metrics_stale_s=max(admission.metrics_stale_ms / 1000, poll),
        max_inflight=admission.max_inflight_per_backend,
        max_running=max_running,
        headroom_slots=headroom,
        headroom_always=admission.headroom_slots is not None,
        kv_blocks=kv_blocks if kv_on else None,
        block_size=block_size,
        kv_reserve_blocks=reserve,
        max_prefill_tokens_inflight=prefill_limit(admission.max_prefill_tokens_inflight, 1),
        max_backend_prefill_tokens=prefill_limit(admission.max_backend_prefill_tokens, 2),
        poll_s=poll,
    )


def _waiting_bound(admission: Admission, slots: int | None) -> int:
    """W: the config's, else max(2, S/8), or 8 while S is unknown."""
    if admission.max_backend_waiting is not None:
        return admission.max_backend_waiting
    if slots is None:
        return WAITING_UNKNOWN_SLOTS
    return max(2, slots // 8)


def _running_cap(admission: Admission, shape: EngineShape, waiting: int) -> int | None:
    """The fresh cap: the config's, else the learned slots plus the waiting bound (None
    while they are unknown)."""
    if admission.max_running_per_backend is not None:
        return admission.max_running_per_backend
    if shape.slots is None:
        return None
    max_running = shape.slots + waiting
    if "max_inflight_per_backend" in admission.model_fields_set:
        # A configured in-flight cap bounds the fresh one too, as it always did.
        max_running = min(max_running, admission.max_inflight_per_backend)
    return max_running


def _headroom(admission: Admission, shape: EngineShape, slots: int | None, waiting: int,
              fresh_cap: int, tenant_aware: bool) -> int:
    """The slots kept for tenants under their share, before the caps bound it."""
    learned = admission.max_running_per_backend is None
    if admission.headroom_slots is not None:
        # Configured headroom means *running* slots kept free: above the learned slots the
        # cap holds requests that wait in the engine, which free no slot for anyone.
        headroom = admission.headroom_slots
        if learned and shape.slots is not None:
            headroom += max(0, fresh_cap - shape.slots)
        return headroom
    if not tenant_aware or slots is None:
        return 0
    if learned and not shape.slots_exact:
        # The slots are a lower bound: a lone tenant may hold half the waiting bound past
        # them (the probe that lets a larger engine show its size, sidecar.shape), and the
        # other half stays for everyone else. An engine that has no more slots queues
        # those few, which makes the count exact and brings the full headroom below.
        return max(1, waiting - waiting // 2)
    return fresh_cap - (slots - max(1, slots // 8))


def _kv_reserve(admission: Admission, kv_blocks: int | None, slots: int | None) -> int:
    """The KV blocks above the watermark: the config's, else the slots' reserve fraction of
    the cache; at most all but one block."""
    assert kv_blocks is not None
    if admission.kv_reserve_blocks is not None:
        reserve = admission.kv_reserve_blocks
    else:
        reserve = math.ceil(kv_blocks * reserve_fraction(slots))
    return max(0, min(reserve, kv_blocks - 1))


def _poll_s(admission: Admission, shape: EngineShape) -> float:
    """The scrape period: the config's, else POLL_STEPS engine steps within POLL_BOUNDS_S,
    and at least POLL_SCRAPE_MULTIPLE scrapes' durations (up to POLL_COST_CAP_S)."""
    if admission.metrics_poll_ms is not None:
        return admission.metrics_poll_ms / 1000
    if shape.step_s is not None:
        poll = min(max(POLL_STEPS * shape.step_s, POLL_BOUNDS_S[0]), POLL_BOUNDS_S[1])
    else:
        poll = DEFAULT_POLL_S
    if shape.scrape_s is not None:
        poll = max(poll, min(POLL_SCRAPE_MULTIPLE * shape.scrape_s, POLL_COST_CAP_S))
    return poll


class AdmissionGate:
    """One backend's gate (module doc). With ``derive``, the gate learns the engine's shape
    from its scrapes (``weighbridge.sidecar.shape``) and its limits become ``derive(shape)`` after
    each one; without, ``limits`` stay as given."""

    def __init__(self, limits: GateLimits,
                 derive: Callable[[EngineShape], GateLimits] | None = None) -> None:
        self.limits = limits
        self._derive = derive
        self._learner = ShapeLearner()
        self._inflight = 0
        self._sample: BackendSample | None = None
        self._decode_per_seq: float | None = None  # tokens/s per running sequence
        self._dispatched_since = 0
        self._finished_since = 0
        self._awaiting_first_token = 0  # ours in flight here, not yet prefilled
        self._foreign_waiting = 0.0  # waiting at the last scrape that cannot have been ours
        self.holds: Counter[str] = Counter()  # reason -> dispatch attempts held

    # ------------------------------------------------------------------ inputs

    @property
    def inflight(self) -> int:
        return self._inflight

    def on_dispatched(self, now: float) -> None:
        del now  # counted against the latest scrape, whenever it was
        self._inflight += 1
        self._dispatched_since += 1
        self._awaiting_first_token += 1

    def on_first_token(self, now: float) -> None:
        """One of ours here was prefilled: it is certainly not in the waiting queue."""
        del now
        if self._awaiting_first_token <= 0:
            raise ValueError("on_first_token without a matching on_dispatched")
        self._awaiting_first_token -= 1

    def on_finished(self, now: float, *, awaiting_first_token: bool = False) -> None:
        """A request of ours here ended; ``awaiting_first_token`` if it ended before its
        first token (``on_first_token`` was never called for it)."""
        del now
        if self._inflight <= 0:
            raise ValueError("on_finished without a matching on_dispatched")
        if awaiting_first_token:
            if self._awaiting_first_token <= 0:
                raise ValueError("on_finished(awaiting_first_token) but none awaits")
            self._awaiting_first_token -= 1
        self._inflight -= 1
        self._finished_since += 1

    def observe(self, sample: BackendSample) -> None:
        previous = self._sample
        if previous is not None and sample.at_s < previous.at_s:
            return  # a late answer to an older scrape: keep the newer view
        self._decode_per_seq = _decode_per_seq(previous, sample)
        # Our cap bound at this scrape and the engine ran all of it with nothing waiting: it
        # has at least that many slots (sidecar.shape: how an engine larger than the cap
        # gets its slots learned at all).
        at_cap = (self._inflight > 0 and self._inflight >= self.cap(sample.at_s)
                  and sample.waiting <= 0 and sample.running >= self._inflight)
        self._sample = sample
        if self._derive is not None:
            shape = self._learner.observe(sample, self.limits.poll_s)
            if at_cap:
                shape = self._learner.runs_at_least(int(sample.running))
            self.limits = self._derive(shape)
        # Ours awaiting a first token now were dispatched before the answer came; some may
        # have been prefilled since the scrape was sent, which only makes this larger.
        self._foreign_waiting = max(0.0, sample.waiting - self._awaiting_first_token)
        self._dispatched_since = 0
        self._finished_since = 0

    # ------------------------------------------------------------------ view

    def fresh(self, now: float) -> bool:
        return self._sample is not None and now - self._sample.at_s <= self.limits.metrics_stale_s

    def cap(self, now: float) -> int:
        """The in-flight cap in force: the concurrency target, or the fallback when stale."""
        if self.fresh(now):
            return self.limits.max_running or self.limits.max_inflight
        return self.limits.max_inflight

    def share_slots(self, now: float) -> int:
        """Slots that count for weighted shares: the cap without the headroom."""
        return self.cap(now) - self.limits.headroom_slots

    @property
    def shape(self) -> EngineShape:
        """What the gate learned of its engine (empty without ``derive``)."""
        return self._learner.shape

    @property
    def decode_tokens_per_s_per_seq(self) -> float | None:
        return self._decode_per_seq

    @property
    def kv_cache_usage(self) -> float | None:
        return None if self._sample is None else self._sample.kv_cache_usage

    def estimated_waiting(self, now: float) -> float | None:
        """The backend's waiting queue now, from the last scrape and our own traffic since."""
        sample = self._sample
        if sample is None:
            return None
        free = 0.0
        if sample.waiting <= 0:
            free = max(0.0, self.cap(now) - sample.running)
        since = sample.waiting + self._dispatched_since - self._finished_since - free
        return max(0.0, min(since, self._foreign_waiting + self._awaiting_first_token))

    def verdict(self, now: float) -> GateVerdict:
        limits = self.limits
        fresh = self.fresh(now)
        cap = (limits.max_running or limits.max_inflight) if fresh else limits.max_inflight
        slots = cap - limits.headroom_slots
        if self._inflight >= cap:
            return GateVerdict("closed", "inflight_cap" if fresh else "fallback_cap", slots)
        if fresh and self._inflight > 0:
            waiting = self.estimated_waiting(now)
            if waiting is not None and waiting > limits.max_backend_waiting:
                return GateVerdict("closed", "backend_waiting", slots)
            speed = self._decode_per_seq
            if speed is not None and speed < limits.min_decode_tokens_per_s:
                return GateVerdict("closed", "decode_slow", slots)
        if limits.headroom_slots and self._inflight >= slots:
            return GateVerdict("headroom", "headroom", slots)
        return GateVerdict("open", "", slots)

    def snapshot(self, now: float) -> dict[str, Any]:
        sample = self._sample
        verdict = self.verdict(now)
        return {
            "inflight": self._inflight,
            "cap": self.cap(now),
            "fresh": self.fresh(now),
            "verdict": verdict.mode,
            "reason": verdict.reason,
            "estimated_waiting": self.estimated_waiting(now),
            "awaiting_first_token": self._awaiting_first_token,
            "foreign_waiting": self._foreign_waiting,
            "decode_tokens_per_s_per_seq": self._decode_per_seq,
            "learned": {"slots": self.shape.slots, "kv_blocks": self.shape.kv_blocks,
                        "block_size": self.shape.block_size, "step_s": self.shape.step_s,
                        "scrape_s": self.shape.scrape_s},
            "limits": {"max_backend_waiting": self.limits.max_backend_waiting,
                       "max_running": self.limits.max_running,
                       "headroom_slots": self.limits.headroom_slots,
                       "kv_blocks": self.limits.kv_blocks,
                       "kv_reserve_blocks": self.limits.kv_reserve_blocks,
                       "max_prefill_tokens_inflight": self.limits.max_prefill_tokens_inflight,
                       "max_backend_prefill_tokens": self.limits.max_backend_prefill_tokens,
                       "poll_s": self.limits.poll_s},
            "scraped": None
            if sample is None
            else {
                "age_s": now - sample.at_s,
                "waiting": sample.waiting,
                "running": sample.running,
                "kv_cache_usage": sample.kv_cache_usage,
            },
            "holds": dict(self.holds),
        }


def _decode_per_seq(previous: BackendSample | None, sample: BackendSample) -> float | None:
    """Generation tokens/s per running sequence between two scrapes, or None when it cannot
    be known (first scrape, no counter, counter reset by an engine restart, nothing ran, or
    nothing ran at one of the two scrapes). An interval that starts or ends with an idle
    engine says nothing about decode speed: a lone request that arrived just before the
    second scrape ran for part of it and spent that part in prefill, so its ~0 tokens read
    as a collapsed decode and held the next request at an idle engine until the following
    scrape (up to ~40 ms of queueing for a victim alone, in virtual time:
    benchmarks/isolation_tradeoff.py's quiet arm through the sidecar)."""
    if (
        previous is None
        or previous.generation_tokens_total is None
        or sample.generation_tokens_total is None
        or sample.at_s <= previous.at_s
        or sample.generation_tokens_total < previous.generation_tokens_total
        or previous.running <= 0
        or sample.running <= 0
    ):
        return None
    running = (previous.running + sample.running) / 2  # tokens accrued across the interval
    if running <= 0:
        return None
    rate = (sample.generation_tokens_total - previous.generation_tokens_total) / (
        sample.at_s - previous.at_s
    )
    return rate / running


def vllm_priority(tier_priority: int, over_share: bool, demotion: int = 1) -> int:
    """The ``priority`` to send to a backend running ``--scheduling-policy priority``: the
    tier's, demoted (a larger number is served later and preempted first) when the tenant
    is over its share, so KV pressure evicts the flood before the well-behaved."""
    return tier_priority + (demotion if over_share else 0)
