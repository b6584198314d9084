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

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from weighbridge.config import Admission

GateMode = Literal["open", "headroom", "closed"]


class ScrapedMetrics(Protocol):
    """What the gate reads from a scrape (``sidecar.scrape.BackendSample`` has these)."""

    @property
    def at_s(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def running(self) -> float: ...
    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def generation_tokens_total(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One scrape of a backend's /metrics. ``at_s`` is when the scrape was *sent* (sidecar
    clock): dispatches after it are certainly not in it."""

    at_s: float
    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc, 0..1
    generation_tokens_total: float | None = None  # vllm:generation_tokens_total (counter)


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

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or (self.max_running is not None and self.max_running < 1):
            raise ValueError("caps must be at least 1")
        smallest = min(self.max_inflight, self.max_running or self.max_inflight)
        if not 0 <= self.headroom_slots < smallest:
            # headroom == cap would leave no slot for a lone over-share tenant: blocked forever.
            raise ValueError(f"headroom_slots must be in [0, {smallest}), got "
                             f"{self.headroom_slots}")

    @classmethod
    def from_config(cls, admission: Admission) -> GateLimits:
        return cls(
            max_backend_waiting=admission.max_backend_waiting,
            min_decode_tokens_per_s=admission.min_decode_tokens_per_s,
            metrics_stale_s=admission.metrics_stale_ms / 1000,
            max_inflight=admission.max_inflight_per_backend,
            max_running=admission.max_running_per_backend,
            headroom_slots=admission.headroom_slots,
        )


class AdmissionGate:
    """One backend's gate (module doc)."""

    def __init__(self, limits: GateLimits) -> None:
        self.limits = limits
        self._inflight = 0
        self._sample: ScrapedMetrics | None = None
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

    def observe(self, sample: ScrapedMetrics) -> None:
        previous = self._sample
        if previous is not None and sample.at_s < previous.at_s:
            return  # a late answer to an older scrape: keep the newer view
        self._decode_per_seq = _decode_per_seq(previous, sample)
        self._sample = sample
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


def _decode_per_seq(previous: ScrapedMetrics | None, sample: ScrapedMetrics) -> float | None:
    """Generation tokens/s per running sequence between two scrapes, or None when it cannot
    be known (first scrape, no counter, counter reset by an engine restart, nothing ran)."""
    if (
        previous is None
        or previous.generation_tokens_total is None
        or sample.generation_tokens_total is None
        or sample.at_s <= previous.at_s
        or sample.generation_tokens_total < previous.generation_tokens_total
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
