"""Expected output length per (tenant, endpoint), learned from what the backends produced.

DRR charges prompt + *estimated* output at dispatch, because the real output is only known
at the end. A per-tenant estimate (not a global one) matters for fairness: a tenant whose
answers are long must be charged as long from its first request on, or it is served ahead
of its share until settlement catches up.
"""

from __future__ import annotations

from collections.abc import Mapping

# weighbridge.sidecar.config.Endpoint.initial_output_estimate's default
DEFAULT_INITIAL_ESTIMATE = 256


class OutputEstimator:
    """EMA of observed output tokens per sequence, seeded with the endpoint's
    ``initial_output_estimate`` and always capped by the request's ``max_tokens``."""

    def __init__(self, initial: Mapping[str, int], alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._initial = dict(initial)
        self._alpha = alpha
        self._ema: dict[tuple[str, str], float] = {}
        # Observations not yet handed to a shared store (sidecar.shared); None: not shared.
        self._unshared: list[tuple[str, str, int]] | None = None

    @property
    def alpha(self) -> float:
        return self._alpha

    def share(self) -> None:
        """Keep every observation for ``take_observations`` (several replicas share one EMA
        per tenant and endpoint)."""
        if self._unshared is None:
            self._unshared = []

    def take_observations(self) -> list[tuple[str, str, int]]:
        """The observations since the last call, in order: (tenant, endpoint, tokens)."""
        taken, self._unshared = self._unshared or [], ([] if self._unshared is not None
                                                       else None)
        return taken

    def adopt(self, tenant: str, endpoint: str, ema: float) -> None:
        """Take the shared estimate (everyone's observations, this replica's included)."""
        self._ema[(tenant, endpoint)] = ema

    def expected(self, tenant: str, endpoint: str) -> float:
        """The learned mean, before the per-request max_tokens cap."""
        ema = self._ema.get((tenant, endpoint))
        if ema is None:
            return float(self._initial.get(endpoint, DEFAULT_INITIAL_ESTIMATE))
        return ema

    def estimate(self, tenant: str, endpoint: str, max_tokens: int | None,
                 sequences: int = 1) -> int:
        """Every sequence's expected output: ``sequences`` times the learned mean per
        sequence, each capped by ``max_tokens``."""
        value = round(self.expected(tenant, endpoint))
        per_sequence = value if max_tokens is None else max(0, min(value, max_tokens))
        return sequences * per_sequence

    def observe(self, tenant: str, endpoint: str, output_tokens: int) -> None:
        """Feed the real output of a *completed* request. Cancelled or failed requests are
        truncated and would bias the estimate low, so the caller leaves them out."""
        if self._unshared is not None:
            self._unshared.append((tenant, endpoint, output_tokens))
        key = (tenant, endpoint)
        previous = self._ema.get(key)
        if previous is None:
            # The first observation replaces the seed outright rather than being averaged
            # with it: the seed is a guess about no one in particular.
            self._ema[key] = float(output_tokens)
        else:
            self._ema[key] = previous + self._alpha * (output_tokens - previous)
