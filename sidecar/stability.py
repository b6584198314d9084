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

Utilisation rho: the warning before overload
--------------------------------------------
The ratio answers only once the backlog grows. rho answers before: it puts the offered work
against the seed's own capacity, ``B / t_step``, with ``B`` the step budget
(``admission.step_budget_tokens``, vLLM's ``--max-num-batched-tokens``, 2,048 by default)
and ``t_step`` the time of a step that fills it, learned from each backend's scrapes
(``StepTime``). So ``rho = offered tokens/s x t_step / B``: the share of the engines'
capacity the offered work takes. It grows in proportion to the load and reaches 1 where
the backlog starts to grow; the alert (deploy/prometheus/rules/sidecar.yml) fires on it
held above 0.9.

``t_step`` is the *full* step's time, not the mean step's (``EngineShape.step_s``, what
the admission gate learns): an engine under light load runs small steps, which are fast,
so with the mean step rho is the share of each step filled: in the ramp test's setting it
read 0.12 at half of capacity and 0.49 at 85 % (0.30 with 512-token prompts and 64-token
outputs), and rose to 1 only at the knee, together with the queue.

* Per backend, the offered work is what the sidecar routes there: at dispatch, the prompt
  tokens the engine computes (less its predicted prefix-cache hits) plus the expected
  output (``route``). Admission holds what a backend cannot take in the sidecar's queue,
  so a backend's rho stays near or below 1; the pool's says how far past that the load is.
* Per pool (the backends that serve the same models, ``weighbridge.sidecar.catalog``), the
  offered work is every request that arrives for the pool, admitted or not, prompt plus
  expected output as the stability ratio counts it (``offer``); its capacity is the sum
  of ``B / t_step`` over the pool's healthy backends whose step time is known.
* ``t_step`` is learned from decoding (one token per running sequence per step) over the
  window; with no decoding in the window, the step time the gate learned last stands in
  (``learned_step_s``). Before either is known rho is *absent*, never 0 (an engine that
  has not decoded has not shown its speed; 0 would read as "no load"). A pool's rho is
  absent while none of its healthy backends has a step time.

What rho does not see: an engine bound by its slots or KV cache before its step budget
(long outputs on few slots) saturates with its steps part empty, so its rho stays below 1
while its queue grows. The stability ratio and the backends' waiting queues cover that
case; docs/sidecar.md, "Stability and utilisation".

Pure: time is passed in (seconds, one monotonic clock), no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from weighbridge.sidecar.admission import DEFAULT_STEP_BUDGET, AdmissionGate
from weighbridge.sidecar.catalog import ModelCatalog
from weighbridge.statistics import stability_ratio, step_capacity, utilisation

if TYPE_CHECKING:
    from weighbridge.sidecar.config import Admission

# Long enough to smooth a 250 ms scrape cadence and bursty arrivals, short enough to show an
# overload within seconds (Prometheus recording rules give the minute-scale view).
DEFAULT_WINDOW_S = 10.0

K = TypeVar("K")


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

    def rate(self, now: float, min_span_s: float = 0.0) -> float | None:
        """Per second over the window, or None: fewer than two samples, samples spanning
        less than ``min_span_s``, or the newest is older than the window (the source went
        quiet, so its old rate means nothing)."""
        if len(self._points) < 2:
            return None
        (t0, v0), (t1, v1) = self._points[0], self._points[-1]
        if t1 <= t0 or t1 - t0 < min_span_s or now - t1 > self.window_s:
            return None
        return (v1 - v0) / (t1 - t0)


@dataclass(slots=True)
class StepTime:
    """One engine's step time over the last ``window_s`` seconds of scrapes.

    Between two scrapes the engine took about ``generated / running`` steps (each running
    sequence decodes one token a step), in ``interval`` seconds, over ``prompt +
    generated`` tokens: one point (tokens per step, seconds per step). ``mean_s`` is the
    window's mean step time, ``EngineShape.step_s``'s estimate summed over the window.
    ``full_s`` is the time of a step that fills the budget: a step costs a fixed part (the
    weights read) plus a part per token, so a fit ``t = t_fixed + t_token x n`` over the
    window's points, read at ``n = B``. Under light load the engine runs small, fast steps,
    so the mean step time alone makes rho the share of each step filled, which stays low
    until the very knee (module doc) and cannot warn.
    The fit is held between two bounds the data give whatever its noise: at least the mean
    step (a full step is no faster than a part-empty one) and at most ``B`` times the
    mean seconds per token (the fixed part is not negative), where rho equals the offered
    over the served tokens. A sequence still prefilling counts as running but decodes
    nothing, so long prompts with short outputs make the steps look fewer and longer (rho
    about 0.05 high in the ramp test, 1.12 for its saturated backend).
    """

    window_s: float
    # (time, generation tokens counter, prompt + generation counter, running), oldest first
    _points: deque[tuple[float, float, float, float]] = field(default_factory=deque)

    def observe(self, at_s: float, generation_tokens_total: float,
                processed_tokens_total: float, running: float) -> None:
        if self._points and at_s <= self._points[-1][0]:
            return  # out of order, or a repeat
        self._points.append((at_s, generation_tokens_total, processed_tokens_total, running))
        horizon = at_s - self.window_s
        while len(self._points) > 2 and self._points[1][0] <= horizon:
            self._points.popleft()

    def _intervals(self, now: float) -> list[tuple[float, float, float]]:
        """(steps, seconds, tokens) of each interval with decoding in it; none when the
        newest scrape is older than the window."""
        points = self._points
        if len(points) < 2 or now - points[-1][0] > self.window_s:
            return []
        out = []
        previous = points[0]
        for point in list(points)[1:]:
            (t0, g0, p0, r0), (t1, g1, p1, r1) = previous, point
            previous = point
            running = (r0 + r1) / 2
            if g1 <= g0 or p1 < p0 or running <= 0:
                continue  # no decoding, or a counter reset (a restarted engine)
            steps = (g1 - g0) / running
            out.append((steps, t1 - t0, p1 - p0))
        return out

    def mean_s(self, now: float) -> float | None:
        """Seconds per step over the window; None without decoding in it."""
        intervals = self._intervals(now)
        steps = math.fsum(i[0] for i in intervals)
        return math.fsum(i[1] for i in intervals) / steps if steps > 0 else None

    def full_s(self, now: float, budget_tokens: float) -> float | None:
        """Seconds per step of ``budget_tokens`` tokens (class doc); None without decoding
        in the window."""
        intervals = self._intervals(now)
        steps = math.fsum(i[0] for i in intervals)
        if steps <= 0:
            return None
        seconds = math.fsum(i[1] for i in intervals)
        tokens = math.fsum(i[2] for i in intervals)
        mean_step, mean_n = seconds / steps, tokens / steps
        upper = seconds / tokens * budget_tokens if tokens > 0 else mean_step
        # Least squares of seconds per step on tokens per step, each interval weighted by
        # its steps (an interval of many steps is a better average).
        sxx = math.fsum(w * (n / w - mean_n) ** 2 for w, _, n in intervals)
        if sxx <= 0:
            return mean_step  # every interval alike: nothing to read a slope from
        sxy = math.fsum(w * (n / w - mean_n) * (t / w - mean_step) for w, t, n in intervals)
        slope = sxy / sxx
        fitted = mean_step + slope * (budget_tokens - mean_n)
        return min(max(fitted, mean_step), max(upper, mean_step))


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
        self._steps: dict[str, StepTime] = {}
        # Offered tokens by the pool they arrived for, and routed tokens by backend: totals
        # and their windowed rates, sampled together with the offered total.
        self._pool_totals: dict[frozenset[str], float] = {}
        self._pool_rates: dict[frozenset[str], CounterRate] = {}
        self._routed_totals: dict[str, float] = {}
        self._routed_rates: dict[str, CounterRate] = {}

    def offer(self, tokens: float, pool: frozenset[str] | None = None) -> None:
        """A request arrived with ``tokens`` (prompt plus expected output), for ``pool`` (the
        backends that may serve it; None or empty: no pool serves it)."""
        self.offered_tokens_total += tokens
        if pool:
            self._pool_totals[pool] = self._pool_totals.get(pool, 0.0) + tokens

    @property
    def offered_by_pool(self) -> dict[frozenset[str], float]:
        """Offered tokens so far by the pool they arrived for (a copy)."""
        return dict(self._pool_totals)

    def route(self, backend: str, tokens: float) -> None:
        """The sidecar sent ``backend`` a request of ``tokens`` (computed prompt plus
        expected output)."""
        self._routed_totals[backend] = self._routed_totals.get(backend, 0.0) + tokens

    def sample(self, now: float) -> None:
        """Record the totals now (call periodically, and before reading)."""
        self._offered.observe(now, self.offered_tokens_total)
        _observe_totals(self._pool_totals, self._pool_rates, now, self.window_s)
        _observe_totals(self._routed_totals, self._routed_rates, now, self.window_s)

    def observe_backend(self, backend: str, at_s: float, processed_tokens_total: float,
                        generation_tokens_total: float | None = None,
                        running: float | None = None) -> None:
        """A scrape of ``backend``: its prompt plus generation tokens counter, and (for its
        step time) its generation tokens counter and running sequences."""
        rate = self._served.get(backend)
        if rate is None:
            rate = self._served[backend] = CounterRate(self.window_s)
        rate.observe(at_s, processed_tokens_total)
        if generation_tokens_total is not None and running is not None:
            step = self._steps.get(backend)
            if step is None:
                step = self._steps[backend] = StepTime(self.window_s)
            step.observe(at_s, generation_tokens_total, processed_tokens_total, running)

    def step_s(self, backend: str, now: float, learned_s: float | None = None,
               budget_tokens: int = DEFAULT_STEP_BUDGET) -> float | None:
        """``backend``'s full-step time over the window (``StepTime.full_s``);
        ``learned_s`` (what its gate learned, ``learned_step_s``) while the window has no
        decoding in it."""
        step = self._steps.get(backend)
        windowed = None if step is None else step.full_s(now, budget_tokens)
        return learned_s if windowed is None else windowed

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

    def utilisation(self, now: float, learned_s: Mapping[str, float | None],
                    healthy: Collection[str], pools: Iterable[frozenset[str]],
                    budget_tokens: int = DEFAULT_STEP_BUDGET) -> Utilisation:
        """rho now (module doc) of every backend in ``learned_s`` (the step time its gate
        learned, None while unknown: ``step_s`` prefers the window's) and of every pool in
        ``pools`` (the pools there are now: a pool no longer there is forgotten). A backend
        nothing was routed to yet reads 0 once its step time is known."""
        step_s = {b: self.step_s(b, now, learned, budget_tokens)
                  for b, learned in learned_s.items()}
        for backend in step_s:
            if backend not in self._routed_totals:
                self.route(backend, 0.0)  # counted from now, so an idle backend reads 0
        current = set(pools)
        for gone in [p for p in self._pool_totals if p not in current]:
            del self._pool_totals[gone]
            self._pool_rates.pop(gone, None)
        for pool in current:
            self._pool_totals.setdefault(pool, 0.0)  # an idle pool reads 0, as a backend
        self.sample(now)
        capacities = {b: step_capacity(budget_tokens, s) for b, s in step_s.items()}
        # A rate over the first moments of a counter is one burst, not a load.
        span = self.window_s / 2
        backends: dict[str, float] = {}
        for backend, capacity in capacities.items():
            routed = self._routed_rates[backend].rate(now, span)
            if capacity is not None and routed is not None:
                value = utilisation(routed, [capacity])
                if value is not None:
                    backends[backend] = value
        by_pool: dict[str, float] = {}
        for pool in current:
            offered = self._pool_rates[pool].rate(now, span)
            known = [c for b in pool if b in healthy
                     and (c := capacities.get(b)) is not None]
            value = None if offered is None else utilisation(offered, known)
            if value is not None:
                by_pool[pool_label(pool)] = value
        return Utilisation(backends, by_pool)


@dataclass(frozen=True, slots=True)
class Utilisation:
    """rho by backend and by pool label (``pool_label``); a name is absent while its rho is
    unknown (module doc)."""

    backends: dict[str, float]
    pools: dict[str, float]


def pool_label(pool: Iterable[str]) -> str:
    """A pool's name in labels and reports: its backends, sorted, comma-separated. There
    are at most as many as the fleet has distinct sets of served models."""
    return ",".join(sorted(pool))


def current_pools(catalog: ModelCatalog) -> set[frozenset[str]]:
    """The pools requests arrive for now: each served model's, and the default model's."""
    pools = {backends for backends in catalog.models().values() if backends}
    default = catalog.backends_for(None)
    if default:
        pools.add(default)
    return pools


def step_budget(admission: Admission) -> int:
    """B: the engines' step budget as configured, else vLLM's serving default (as the
    admission limits take it, ``weighbridge.sidecar.admission.derive_limits``)."""
    return admission.step_budget_tokens or DEFAULT_STEP_BUDGET


def learned_step_s(gate: AdmissionGate) -> float | None:
    """A backend's step time: what its gate learned of the engine (``EngineShape.step_s``);
    a gate with fixed limits learns no shape, so its last decode speed stands in (the same
    measurement: one token per running sequence per step)."""
    step = gate.shape.step_s
    if step is not None:
        return step
    per_seq = gate.decode_tokens_per_s_per_seq
    return 1.0 / per_seq if per_seq else None


def _observe_totals(totals: Mapping[K, float], rates: dict[K, CounterRate], now: float,
                    window_s: float) -> None:
    for key, total in totals.items():
        rate = rates.get(key)
        if rate is None:
            rate = rates[key] = CounterRate(window_s)
        rate.observe(now, total)
