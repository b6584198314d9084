"""Early rejection: predict how long a new request would wait upstream, in O(1).

The wait is the token work that will be served before this request's first token, over the
fleet's measured token throughput. Under the fair policies that work is

* everything queued in higher tiers (strict priority serves it first), plus
* in the request's tier, what DRR serves while the tenant's own backlog (its queued tokens
  plus this request's prompt) drains at its weighted share ``w_t / W`` of the tier:
  ``mine * W / w_t``, but never more than the whole tier backlog (other tenants may run dry
  first). ``W`` sums the weights of the backlogged tenants, the newcomer included.

An arrival with nothing queued ahead of it in its pool has no wait to predict: it is
dispatched at the next pass, and its own prefill is the engine's to time (the served rate,
mostly decode, would overstate it many times over), so it is never turned away early.

Tokens are the ones the engine computes (``QueuedRequest.computed_tokens``, what DRR
charges): a queued request's and the newcomer's prompt count only what no backend of the pool
is predicted to hold in its prefix cache, set at arrival (``SchedulingCore.arrive``). The
throughput is measured in the same unit, so a cached history costs only its new tokens.

Under fcfs everything queued is ahead. The tenant's whole backlog is counted even if this
request's priority would put it first: pessimistic for urgent requests, but O(1) (an exact
position would need an order-statistics tree per tenant).

Throughput is only measured while requests wait upstream: when the queue is empty the served
rate says how much was *asked*, not how much the backends *can* do, and an idle spell would
otherwise drag the estimate to zero and reject the next burst wholesale.
"""

from __future__ import annotations

from collections.abc import Iterable

from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import BacklogView, Scheduler


class ThroughputMeter:
    """EMA of served tokens per second over windows in which requests were waiting."""

    def __init__(self, window_s: float = 1.0, alpha: float = 0.3) -> None:
        if not window_s > 0 or not 0 < alpha <= 1:
            raise ValueError("window_s must be positive and alpha in (0, 1]")
        self._window_s = window_s
        self._alpha = alpha
        self._start: float | None = None
        self._tokens = 0.0
        self._rate: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """None until a full saturated window has been seen."""
        return self._rate

    def observe(self, tokens: float, now: float, saturated: bool) -> None:
        """Tokens served (computed prompt or output, as they are reported) at ``now``;
        ``saturated`` says whether requests are waiting upstream. Call with 0 tokens on other
        events too, so a backend that stops producing drags the rate down instead of
        freezing it."""
        if not saturated:
            self._start = None  # the current window is not a capacity measurement
            self._tokens = 0.0
            return
        if self._start is None:
            # Tokens reported now were produced (partly) before saturation began.
            self._start = now
            self._tokens = 0.0
            return
        self._tokens += tokens
        elapsed = now - self._start
        if elapsed >= self._window_s:
            sample = self._tokens / elapsed
            if self._rate is None:
                # A first window with nothing served (long prefills still running, a stalled
                # backend) says nothing about capacity; a rate of 0 would make every deadline
                # look unmeetable. Stay unknown until something is served.
                self._rate = sample if sample > 0 else None
            else:
                self._rate += self._alpha * (sample - self._rate)
            self._start = now
            self._tokens = 0.0


def tokens_ahead(view: BacklogView, own_tokens: int) -> float:
    """Token work served before a new request's first token (module doc)."""
    if view.fifo:
        return 0.0 if view.total_tokens == 0 else view.total_tokens + own_tokens
    if view.higher_tiers_tokens == 0 and view.tier_tokens == 0:
        return 0.0  # nothing ahead: dispatched at the next pass (module doc)
    weight = view.tier_weight + (0.0 if view.tenant_backlogged else view.tenant_weight)
    mine = view.tenant_tokens + own_tokens
    in_tier = min(view.tier_tokens + own_tokens, mine * weight / view.tenant_weight)
    return view.higher_tiers_tokens + in_tier


class WaitPredictor:
    def __init__(self, scheduler: Scheduler, meter: ThroughputMeter) -> None:
        self._scheduler = scheduler
        self._meter = meter

    def predicted_wait_s(self, request: QueuedRequest) -> float | None:
        """Seconds until the request's first token, or None while throughput is unknown."""
        rate = self._meter.tokens_per_s
        if rate is None:
            return None
        view = self._scheduler.backlog_view(request.tier, request.tenant)
        ahead = tokens_ahead(view, request.computed_prompt_tokens)
        if rate <= 0:
            return 0.0 if ahead <= 0 else float("inf")
        return ahead / rate

    def deadline_unmeetable(
        self, request: QueuedRequest, now: float, service_s: float = 0.0
    ) -> bool:
        """True when ``now + predicted wait (+ service_s)`` is past the request's deadline.

        ``service_s`` is time the request needs after its first token (for an end-to-end
        deadline: its expected output over the per-sequence decode speed); 0 for TTFT.
        Unknown throughput never rejects: a fresh sidecar serves before it judges.
        """
        if request.deadline_s is None:
            return False
        if now + service_s >= request.deadline_s:
            return True  # already too late, whatever the backlog
        wait = self.predicted_wait_s(request)
        return wait is not None and now + wait + service_s > request.deadline_s


def decode_s(request: QueuedRequest, speeds: Iterable[float | None]) -> float:
    """Seconds to decode the request's expected output after its first token: per sequence
    at the median of ``speeds`` (each engine's tokens/s for one sequence now; None: not
    known); 0 while none is known (a fresh sidecar serves before it judges)."""
    known = sorted(speed for speed in speeds if speed)
    if not known:
        return 0.0
    per_sequence = request.estimated_output_tokens / max(1, request.sequences)
    return per_sequence / known[len(known) // 2]
