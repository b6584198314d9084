"""Little's Law over a sliding window: is what the generator counts consistent with itself?

For a window of length T ending at t:

* **L** is the time-average of the number in system over the window, the exact integral of
  the piecewise-constant in-flight count divided by T;
* **λ·W** is (completions in the window / T) x (mean time in system of those completions),
  i.e. the sum of the completions' *whole* times in system over T.

The two differ only at the window's edges: a request that entered before the window and
completes inside it adds its whole time to λ·W but only its in-window part to L, and a
request still in flight at t adds to L only. In a steady state the two edges balance, so the
ratio L / λ·W is 1 within O(W/T). A generator that loses requests breaks the balance for
good: a request that enters but never completes keeps adding to L (ratio above 1), a
completion whose entry was never counted adds to λ·W only (ratio below 1).

**Levels.** At the ``request`` level every request weighs 1. At the ``token`` level a
request weighs the tokens it was *declared* with when it entered (prompt tokens + max_tokens
for the load generator), held constant from entry to completion. The declared count is used
on both sides because it is the only count known while the request is in flight: the real
output length arrives with the completion, and re-weighting the past then would make the
occupancy integral go backwards, which a Prometheus counter cannot do.

Everything here is pure: times are passed in (seconds on any one monotonic clock), nothing
reads a clock or does I/O. Keys are opaque (the exporter uses ``(tenant, tier)``); window
sums are linear, so readings of several keys add up exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "LEVELS",
    "Level",
    "LittlesLawReading",
    "LittlesLawTotals",
    "LittlesLawWindow",
]

Level = Literal["request", "token"]
LEVELS: tuple[Level, ...] = ("request", "token")


@dataclass(frozen=True, slots=True)
class LittlesLawReading:
    """One level of one key (or sum of keys) over the window."""

    l: float  # noqa: E741 - the queueing-theory name; time-average number in system
    lambda_w: float  # completion rate x mean time in system of the completions
    completions: int
    span_s: float  # the window length actually covered (shorter right after the start)

    @property
    def ratio(self) -> float:
        """L / λ·W; +inf when requests are in system but none completed, NaN when idle."""
        if self.lambda_w > 0:
            return self.l / self.lambda_w
        return math.inf if self.l > 0 else math.nan

    def __add__(self, other: LittlesLawReading) -> LittlesLawReading:
        # Same window, so sums over disjoint keys are sums of integrals over the same span.
        return LittlesLawReading(self.l + other.l, self.lambda_w + other.lambda_w,
                                 self.completions + other.completions,
                                 max(self.span_s, other.span_s))


@dataclass(frozen=True, slots=True)
class LittlesLawTotals:
    """Cumulative raw series since the start, for a Prometheus recording rule to derive the
    same ratio as ``rate(occupancy) / rate(time_in_system)`` over any window."""

    occupancy_request_seconds: float  # ∫ in-flight requests dt
    occupancy_token_seconds: float  # ∫ in-flight declared tokens dt
    time_in_system_seconds: float  # Σ time in system of completions
    time_in_system_token_seconds: float  # Σ declared tokens x time in system of completions
    completions: int


@dataclass(slots=True)
class _Sums:
    """Σ Δ and Σ Δ·at of occupancy changes, per level; ∫₀ᵗ N = N·t - Σ Δ·at for t after
    every change, whatever order the changes arrived in."""

    n: float = 0.0
    n_at: float = 0.0
    tok: float = 0.0
    tok_at: float = 0.0

    def add(self, dn: float, dtok: float, at: float) -> None:
        self.n += dn
        self.n_at += dn * at
        self.tok += dtok
        self.tok_at += dtok * at

    def integral(self, t: float) -> tuple[float, float]:
        return self.n * t - self.n_at, self.tok * t - self.tok_at


@dataclass(slots=True)
class _Key:
    everything: _Sums = field(default_factory=_Sums)
    # Changes at or before the window's start, folded; the rest wait in a heap by time.
    before_window: _Sums = field(default_factory=_Sums)
    pending: list[tuple[float, int, float, float]] = field(default_factory=list)
    completions: list[tuple[float, int, float, float]] = field(default_factory=list)
    window_count: int = 0
    window_time: float = 0.0
    window_token_time: float = 0.0
    total_count: int = 0
    total_time: float = 0.0
    total_token_time: float = 0.0


class LittlesLawWindow:
    """Occupancy and completions per key; readings over the last ``window_s`` seconds.

    Entries may be reported late (a request enters at its scheduled send time, which can be
    before the last event seen); that is exact. A *leave* reported before the latest reading
    is taken as happening at that reading, so the cumulative occupancy never decreases.
    Reading times must not go backwards.
    """

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be positive, got {window_s}")
        self.window_s = float(window_s)
        self._keys: dict[Hashable, _Key] = {}
        self._origin: float | None = None  # times are kept relative to it (float precision)
        self._read_at = -math.inf  # relative time of the latest reading
        self._seq = 0  # tie-breaker so heaps never compare beyond the time

    # ------------------------------------------------------------------ events

    def entered(self, key: Hashable, tokens: float, at: float) -> None:
        """A request entered the system (for the generator: its scheduled send time)."""
        self._change(key, 1.0, float(tokens), self._rel(at))

    def left(self, key: Hashable, tokens: float, at: float) -> None:
        """A request that :meth:`entered` left the system; ``tokens`` as it entered with."""
        self._change(key, -1.0, -float(tokens), max(self._rel(at), self._read_at))

    def completed(self, key: Hashable, time_in_system_s: float, tokens: float,
                  at: float) -> None:
        """A completion at ``at`` after ``time_in_system_s`` in system (the λ·W side)."""
        if time_in_system_s < 0:
            raise ValueError(f"time_in_system_s: must be >= 0, got {time_in_system_s}")
        state = self._state(key)
        token_time = float(tokens) * time_in_system_s
        state.total_count += 1
        state.total_time += time_in_system_s
        state.total_token_time += token_time
        self._seq += 1
        heapq.heappush(state.completions,
                       (self._rel(at), self._seq, time_in_system_s, token_time))
        state.window_count += 1
        state.window_time += time_in_system_s
        state.window_token_time += token_time

    # ------------------------------------------------------------------ readings

    def keys(self) -> list[Hashable]:
        return list(self._keys)

    def totals(self, key: Hashable, at: float) -> LittlesLawTotals:
        t = self._advance(at)
        state = self._state(key)
        occ_n, occ_tok = state.everything.integral(t)
        return LittlesLawTotals(occ_n, occ_tok, state.total_time, state.total_token_time,
                                state.total_count)

    def reading(self, keys: Iterable[Hashable], at: float) -> dict[Level, LittlesLawReading]:
        """Both levels over the window ending at ``at``, summed over ``keys``."""
        t = self._advance(at)
        start = t - self.window_s
        # Right after the first event the window reaches back before anything happened:
        # average over the time actually covered, so L and λ·W are rates, not diluted.
        span = min(self.window_s, t) if t > 0 else 0.0
        occ_n = occ_tok = time = token_time = 0.0
        count = 0
        for key in keys:
            state = self._keys.get(key)
            if state is None:
                continue
            self._expire(state, start)
            now_n, now_tok = state.everything.integral(t)
            then_n, then_tok = state.before_window.integral(start)
            occ_n += now_n - then_n
            occ_tok += now_tok - then_tok
            count += state.window_count
            time += state.window_time
            token_time += state.window_token_time
        if span <= 0:
            empty = LittlesLawReading(0.0, 0.0, 0, 0.0)
            return {"request": empty, "token": empty}
        return {
            "request": LittlesLawReading(occ_n / span, time / span, count, span),
            "token": LittlesLawReading(occ_tok / span, token_time / span, count, span),
        }

    def expire(self, at: float) -> None:
        """Forget what left the window ending at ``at`` (a reading does this too; call it
        when nobody reads, so memory stays bounded by one window of events)."""
        start = self._advance(at) - self.window_s
        for state in self._keys.values():
            self._expire(state, start)

    def in_flight(self, key: Hashable) -> tuple[float, float]:
        """(requests, declared tokens) in system now for ``key``."""
        state = self._keys.get(key)
        if state is None:
            return 0.0, 0.0
        return state.everything.n, state.everything.tok

    # ------------------------------------------------------------------ internals

    def _rel(self, at: float) -> float:
        if not math.isfinite(at):
            raise ValueError(f"at: must be finite, got {at}")
        if self._origin is None:
            self._origin = at
        return at - self._origin

    def _advance(self, at: float) -> float:
        t = self._rel(at)
        if t < self._read_at:
            raise ValueError(f"at: readings must not go backwards ({at})")
        self._read_at = t
        return t

    def _state(self, key: Hashable) -> _Key:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key()
        return state

    def _change(self, key: Hashable, dn: float, dtok: float, at: float) -> None:
        state = self._state(key)
        state.everything.add(dn, dtok, at)
        self._seq += 1
        heapq.heappush(state.pending, (at, self._seq, dn, dtok))

    def _expire(self, state: _Key, start: float) -> None:
        pending = state.pending
        while pending and pending[0][0] <= start:
            at, _, dn, dtok = heapq.heappop(pending)
            state.before_window.add(dn, dtok, at)
        done = state.completions
        while done and done[0][0] <= start:
            _, _, time, token_time = heapq.heappop(done)
            state.window_count -= 1
            state.window_time -= time
            state.window_token_time -= token_time
        if state.window_count == 0:
            # Running sums drift by rounding as completions come and go; reset when empty.
            state.window_time = state.window_token_time = 0.0
