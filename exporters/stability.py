"""Offered token load against measured serving throughput: the seed's stability condition
λ·(m_prefill + m_decode) < B / t_step, read off live traffic.

* **Offered** tokens/s = requests scheduled per second in the window x mean served tokens
  (prompt + output, from usage) of the requests that completed ``ok`` in the window, i.e.
  λ·(m_prefill + m_decode). Before anything completed, the mean of the declared counts
  (prompt + max_tokens) stands in: an upper bound.
* **Served** tokens/s is the rate of the backend's ``vllm:prompt_tokens_total +
  vllm:generation_tokens_total`` over the window when its scrapes are fresh (at least two
  samples in the window, the latest no older than ``stale_after_s``); otherwise the tokens
  the generator saw served (usage of requests ended in the window) per second.

The ratio offered / served stays near 1 (or below, when others share the backend) while the
system keeps up; held above 1, the backlog grows (or the sidecar sheds) at
(ratio - 1) x served tokens/s, because a saturated server's throughput *is* its capacity.

Pure: times are passed in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from weighbridge.statistics import stability_ratio

__all__ = ["StabilityReading", "StabilityWindow"]

Source = Literal["backend", "client"]


@dataclass(frozen=True, slots=True)
class StabilityReading:
    offered_tokens_per_s: float
    served_tokens_per_s: float
    source: Source  # where the served rate came from

    @property
    def ratio(self) -> float:
        """The stability ratio (weighbridge.statistics), NaN when idle (a gauge's "no
        value")."""
        ratio = stability_ratio(self.offered_tokens_per_s, self.served_tokens_per_s)
        return math.nan if ratio is None else ratio


class StabilityWindow:
    def __init__(self, window_s: float, stale_after_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be positive, got {window_s}")
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s: must be positive, got {stale_after_s}")
        self.window_s = float(window_s)
        self.stale_after_s = float(stale_after_s)
        self._scheduled: list[tuple[float, int, float]] = []  # heap: (at, seq, declared)
        self._done: list[tuple[float, int, float, bool]] = []  # heap: (at, seq, tokens, ok)
        self._backend: deque[tuple[float, float]] = deque()  # (at, counter value)
        self._first_at: float | None = None
        self._seq = 0

    def scheduled(self, declared_tokens: float, at: float) -> None:
        """A request was offered (its scheduled send time ``at``)."""
        self._seen(at)
        self._seq += 1
        heapq.heappush(self._scheduled, (at, self._seq, float(declared_tokens)))

    def ended(self, served_tokens: float, ok: bool, at: float) -> None:
        self._seen(at)
        self._seq += 1
        heapq.heappush(self._done, (at, self._seq, float(served_tokens), ok))

    def backend_sample(self, tokens_total: float, at: float) -> None:
        """The backend's prompt + generation token counter as scraped at ``at``."""
        self._seen(at)
        self._backend.append((at, float(tokens_total)))

    def expire(self, at: float) -> None:
        """Forget what left the window ending at ``at``."""
        start = at - self.window_s
        while self._scheduled and self._scheduled[0][0] <= start:
            heapq.heappop(self._scheduled)
        while self._done and self._done[0][0] <= start:
            heapq.heappop(self._done)
        while self._backend and self._backend[0][0] < start:
            self._backend.popleft()

    def reading(self, at: float) -> StabilityReading:
        self.expire(at)
        span = self.window_s if self._first_at is None else min(self.window_s,
                                                                 at - self._first_at)
        if span <= 0:
            return StabilityReading(0.0, 0.0, "client")

        ok_tokens = [tokens for _, _, tokens, ok in self._done if ok]
        if ok_tokens:
            mean_size = math.fsum(ok_tokens) / len(ok_tokens)
        elif self._scheduled:
            mean_size = math.fsum(t for _, _, t in self._scheduled) / len(self._scheduled)
        else:
            mean_size = 0.0
        offered = len(self._scheduled) / span * mean_size

        backend = self._backend_rate(at)
        if backend is not None:
            return StabilityReading(offered, backend, "backend")
        served = math.fsum(tokens for _, _, tokens, _ in self._done) / span
        return StabilityReading(offered, served, "client")

    def _backend_rate(self, at: float) -> float | None:
        samples = self._backend
        if len(samples) < 2 or at - samples[-1][0] > self.stale_after_s:
            return None
        elapsed = samples[-1][0] - samples[0][0]
        if elapsed <= 0:
            return None
        increase = 0.0
        previous = samples[0][1]
        for _, value in list(samples)[1:]:
            # A counter that went down was reset (backend restart): it counted from 0.
            increase += value - previous if value >= previous else value
            previous = value
        return increase / elapsed

    def _seen(self, at: float) -> None:
        if self._first_at is None or at < self._first_at:
            self._first_at = at
