"""The stability check on live data: offered token load against the backends' serving rate.

A queueing system is stable while work arrives more slowly than it is served:
λ·(m_prefill + m_decode) < B / t_step in the seed's terms. The sidecar sees both sides — the
tokens of the requests that arrive (prompt plus expected output), and each backend's own
``vllm:prompt_tokens_total + vllm:generation_tokens_total`` from its scrapes — and reports
their rates over a sliding window and their ratio. A ratio that stays above 1 means the
backlog grows without bound.

The served rate equals capacity only while the backends are saturated: an under-loaded fleet
serves what it is offered, so its ratio sits near 1 (not below). Read the ratio as "is the
offered load above what the fleet delivers", which is the stability question.

Pure: time is passed in (seconds, one monotonic clock), no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from weighbridge.statistics import stability_ratio

# Long enough to smooth a 250 ms scrape cadence and bursty arrivals, short enough to show an
# overload within seconds (Prometheus recording rules give the minute-scale view).
DEFAULT_WINDOW_S = 10.0


@dataclass(slots=True)
class CounterRate:
    """The rate of a cumulative counter over the last ``window_s`` seconds of samples.

    A value below the previous one is a reset (a restarted backend): the counter restarted
    from zero, as Prometheus' ``rate()`` assumes, so the increase is the new value.
    """

    window_s: float
    # (time, counter value with resets folded in), oldest first
    _points: deque[tuple[float, float]] = field(default_factory=deque)
    _last_raw: float | None = None
    _offset: float = 0.0

    def observe(self, at_s: float, value: float) -> None:
        if self._points and at_s < self._points[-1][0]:
            return  # out of order (a slow scrape answered after a later one): ignore
        if self._last_raw is not None and value < self._last_raw:
            self._offset += self._last_raw
        self._last_raw = value
        self._points.append((at_s, value + self._offset))
        # Keep the newest point at or before the window's start as the anchor of the rate.
        horizon = at_s - self.window_s
        while len(self._points) > 2 and self._points[1][0] <= horizon:
            self._points.popleft()

    def rate(self, now: float) -> float | None:
        """Per second over the window, or None: fewer than two samples, or the newest is
        older than the window (the source went quiet, so its old rate means nothing)."""
        if len(self._points) < 2:
            return None
        (t0, v0), (t1, v1) = self._points[0], self._points[-1]
        if t1 <= t0 or now - t1 > self.window_s:
            return None
        return (v1 - v0) / (t1 - t0)


@dataclass(frozen=True, slots=True)
class Stability:
    offered_tokens_per_s: float | None
    capacity_tokens_per_s: float | None
    capacity_source: str  # "backends" (their scrapes) or "sidecar" (its own throughput meter)

    @property
    def ratio(self) -> float | None:
        """The stability ratio (weighbridge.statistics), offered over capacity; None while
        either is unknown or capacity is zero (the gauge is then absent, not +Inf: a fleet
        whose counters have not moved yet is not known to be overloaded)."""
        if self.offered_tokens_per_s is None or not self.capacity_tokens_per_s:
            return None
        return stability_ratio(self.offered_tokens_per_s, self.capacity_tokens_per_s)


class StabilityMeter:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.offered_tokens_total = 0.0
        self._offered = CounterRate(window_s)
        self._served: dict[str, CounterRate] = {}

    def offer(self, tokens: float) -> None:
        """A request arrived with ``tokens`` (prompt plus expected output)."""
        self.offered_tokens_total += tokens

    def sample(self, now: float) -> None:
        """Record the offered total now (call periodically, and before reading)."""
        self._offered.observe(now, self.offered_tokens_total)

    def observe_backend(self, backend: str, at_s: float, processed_tokens_total: float) -> None:
        """A scrape of ``backend``: its prompt plus generation tokens counter."""
        rate = self._served.get(backend)
        if rate is None:
            rate = self._served[backend] = CounterRate(self.window_s)
        rate.observe(at_s, processed_tokens_total)

    def backend_rate(self, backend: str, now: float) -> float | None:
        rate = self._served.get(backend)
        return None if rate is None else rate.rate(now)

    def read(self, now: float, healthy: Iterable[str],
             sidecar_tokens_per_s: float | None = None) -> Stability:
        """Both sides now. Capacity sums the healthy backends with a known rate; when none
        has one (no scrapes), the sidecar's own throughput measurement stands in."""
        self.sample(now)
        rates = [r for b in healthy if (r := self.backend_rate(b, now)) is not None]
        if rates:
            return Stability(self._offered.rate(now), sum(rates), "backends")
        return Stability(self._offered.rate(now), sidecar_tokens_per_s, "sidecar")
