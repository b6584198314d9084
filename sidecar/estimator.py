"""Expected output length per (tenant, endpoint, model), learned from what the backends
produced.

DRR charges prompt + *estimated* output at dispatch, because the real output is only known
at the end. A per-tenant estimate (not a global one) matters for fairness: a tenant whose
answers are long must be charged as long from its first request on, or it is served ahead
of its share until settlement catches up. The model is part of the key: one tenant's short
answers on one model and long ones on another are two estimates, not their blend
(decision 0019 (d)).

Besides the mean (an EMA, what charges and limits take), each key keeps its last
``HISTORY`` outputs, and ``final`` reads from them what an answer that has generated g
tokens will end at: the mean of the recent outputs longer than g (the mean residual life of
the empirical distribution, seed 000's "empirical service time distributions"). KV-aware
admission and ``least_tokens`` routing count an in-flight answer at that size, so a tenant
whose answers are bimodal is counted at its long mode's size once an answer outgrows the
short one (decision 0018).

Invariants (tests/unit/sidecar/test_estimator.py): ``final`` is never below ``generated``
(unless capped by ``max_tokens``), never above ``max_tokens``; at 0 it is the mean of the
window; a key holds at most ``HISTORY`` outputs.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

# weighbridge.sidecar.config.Endpoint.initial_output_estimate's default
DEFAULT_INITIAL_ESTIMATE = 256

Key = tuple[str, str, str]  # tenant, endpoint, model ("" for a request naming none)
Observation = tuple[str, str, str, int]  # tenant, endpoint, model, output tokens


@dataclass(slots=True)
class _Window:
    """The last outputs of one key in arrival order, the same sorted, and the sums of the
    sorted ones' suffixes (rebuilt on the first read after a change: reads outnumber
    observations by the tokens streamed per answer)."""

    recent: deque[int]
    ordered: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)  # suffix[i] = sum(ordered[i:])
    stale: bool = True

    def add(self, tokens: int) -> None:
        recent, ordered = self.recent, self.ordered
        if len(recent) == recent.maxlen:
            del ordered[bisect.bisect_left(ordered, recent[0])]
        recent.append(tokens)
        bisect.insort(ordered, tokens)
        self.stale = True

    def final(self, generated: int) -> int:
        ordered = self.ordered
        if self.stale:
            suffix = [0] * (len(ordered) + 1)
            for i in range(len(ordered) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + ordered[i]
            self.suffix, self.stale = suffix, False
        i = bisect.bisect_right(ordered, generated)
        if i == len(ordered):
            return generated  # longer than anything seen: no better guess
        return round(self.suffix[i] / (len(ordered) - i))


class OutputEstimator:
    """EMA of observed output tokens per sequence, seeded with the endpoint's
    ``initial_output_estimate`` and always capped by the request's ``max_tokens``; and the
    recent outputs' distribution, for an answer's expected final length (``final``)."""

    HISTORY = 256  # outputs kept per key: enough for a 20% mode to hold ~50 of them

    def __init__(self, initial: Mapping[str, int], alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._initial = dict(initial)
        self._alpha = alpha
        self._ema: dict[Key, float] = {}
        self._windows: dict[Key, _Window] = {}
        # Observations not yet handed to a shared store (sidecar.shared); None: not shared.
        self._unshared: list[Observation] | None = None

    @property
    def alpha(self) -> float:
        return self._alpha

    def share(self) -> None:
        """Keep every observation for ``take_observations`` (several replicas share one EMA
        and one history per tenant, endpoint and model)."""
        if self._unshared is None:
            self._unshared = []

    def take_observations(self) -> list[Observation]:
        """The observations since the last call, in order: (tenant, endpoint, model,
        tokens)."""
        taken, self._unshared = self._unshared or [], ([] if self._unshared is not None
                                                       else None)
        return taken

    def adopt(self, tenant: str, endpoint: str, ema: float, model: str | None = None) -> None:
        """Take the shared estimate (everyone's observations, this replica's included)."""
        self._ema[(tenant, endpoint, model or "")] = ema

    def learn(self, tenant: str, endpoint: str, model: str | None, output_tokens: int) -> None:
        """Another replica's observation: into the history only (the EMA is adopted whole)."""
        self._window((tenant, endpoint, model or "")).add(max(0, output_tokens))

    def expected(self, tenant: str, endpoint: str, model: str | None = None) -> float:
        """The learned mean, before the per-request max_tokens cap."""
        ema = self._ema.get((tenant, endpoint, model or ""))
        if ema is None:
            return float(self._initial.get(endpoint, DEFAULT_INITIAL_ESTIMATE))
        return ema

    def estimate(self, tenant: str, endpoint: str, max_tokens: int | None,
                 sequences: int = 1, model: str | None = None) -> int:
        """Every sequence's expected output: ``sequences`` times the learned mean per
        sequence, each capped by ``max_tokens``."""
        value = round(self.expected(tenant, endpoint, model))
        per_sequence = value if max_tokens is None else max(0, min(value, max_tokens))
        return sequences * per_sequence

    def final(self, tenant: str, endpoint: str, generated: int, max_tokens: int | None,
              model: str | None = None) -> int | None:
        """One sequence's expected final output once it has generated ``generated`` tokens:
        the mean of the key's recent outputs longer than that (``generated`` itself when
        none is), capped by ``max_tokens``; None before any output of the key is seen."""
        window = self._windows.get((tenant, endpoint, model or ""))
        if window is None or not window.ordered:
            return None
        value = window.final(max(0, generated))
        return value if max_tokens is None else max(0, min(value, max_tokens))

    def observe(self, tenant: str, endpoint: str, output_tokens: int,
                model: str | None = None) -> None:
        """Feed the real output of a *completed* request. Cancelled or failed requests are
        truncated and would bias the estimate low, so the caller leaves them out."""
        key = (tenant, endpoint, model or "")
        if self._unshared is not None:
            self._unshared.append((*key, output_tokens))
        self._window(key).add(max(0, output_tokens))
        previous = self._ema.get(key)
        if previous is None:
            # The first observation replaces the seed outright rather than being averaged
            # with it: the seed is a guess about no one in particular.
            self._ema[key] = float(output_tokens)
        else:
            self._ema[key] = previous + self._alpha * (output_tokens - previous)

    def _window(self, key: Key) -> _Window:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(deque(maxlen=self.HISTORY))
        return window
