"""Little's Law per tenant, at request and at token level, from the records' intervals.

Over the run ``[0, T]``, with request ``i`` in the system from its scheduled send ``s_i`` to
its end ``e_i`` and carrying ``k_i`` tokens (prompt + output, as far as known):

* ``L = sum_i |[s_i, e_i] ∩ [0, T]| / T`` (time-average requests in flight),
  ``λ = N / T`` over the ``N`` requests scheduled in ``[0, T)``,
  ``W = mean(e_i - s_i)`` over the same requests; ``request_ratio = L / (λ W)``;
* tokens: ``L_k = sum_i k_i |[s_i, e_i] ∩ [0, T]| / T``, ``λ_k = sum k_i / T``,
  ``W_k = sum k_i (e_i - s_i) / sum k_i``; ``token_ratio = L_k / (λ_k W_k)``.

On a complete record set these close (ratio 1) up to requests that straddle the run's ends;
a ratio away from 1 says records are missing their ends, or run.json's duration disagrees
with the records.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True, slots=True)
class LittlesLaw:
    window_s: float
    arrivals: int
    in_flight: float  # L
    arrival_rate: float  # λ, requests/s
    time_in_system_s: float | None  # W
    tokens_in_flight: float  # L_k
    token_arrival_rate: float  # λ_k, tokens/s
    token_time_in_system_s: float | None  # W_k

    @property
    def request_ratio(self) -> float | None:
        product = self.arrival_rate * (self.time_in_system_s or 0.0)
        return self.in_flight / product if product > 0 else None

    @property
    def token_ratio(self) -> float | None:
        product = self.token_arrival_rate * (self.token_time_in_system_s or 0.0)
        return self.tokens_in_flight / product if product > 0 else None


def littles_law(frame: pd.DataFrame, duration_s: float) -> LittlesLaw:
    """Little's Law over ``[0, duration_s]`` for the requests of ``frame`` (one tenant's)."""
    t = float(duration_s)
    s = frame["scheduled_s"].to_numpy()
    e = frame["end_s"].to_numpy()
    k = frame["tokens"].to_numpy()
    overlap = np.clip(np.minimum(e, t) - np.maximum(s, 0.0), 0.0, None)
    arrived = (s >= 0) & (s < t)
    sojourn = (e - s)[arrived]
    tokens = k[arrived]
    if t <= 0:
        return LittlesLaw(t, int(arrived.sum()), 0.0, 0.0, None, 0.0, 0.0, None)
    token_sum = float(tokens.sum())
    return LittlesLaw(
        window_s=t,
        arrivals=int(arrived.sum()),
        in_flight=float(overlap.sum()) / t,
        arrival_rate=float(arrived.sum()) / t,
        time_in_system_s=float(sojourn.mean()) if sojourn.size else None,
        tokens_in_flight=float((k * overlap).sum()) / t,
        token_arrival_rate=token_sum / t,
        token_time_in_system_s=float((tokens * sojourn).sum()) / token_sum if token_sum else None,
    )


def per_tenant(frame: pd.DataFrame, tenants: list[str], duration_s: float
               ) -> dict[str, LittlesLaw]:
    groups = {str(k): g for k, g in frame.groupby("tenant", observed=True)}
    empty = frame.iloc[:0]
    return {name: littles_law(groups.get(name, empty), duration_s) for name in tenants}
