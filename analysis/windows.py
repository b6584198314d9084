"""Per-tenant time series over fixed windows: token service, time spent backlogged,
requests in flight, TTFT.

* Service: a request's prompt tokens count when its first token arrives (prefill is done),
  its output tokens are spread uniformly from the first token to the last (its end when the
  last token time is unknown).
* Backlogged: the tenant had at least one request waiting, i.e. scheduled but without its
  first token yet (without any first token: until its end). ``backlogged_s`` is the length of
  the union of those waiting intervals inside each window.
* In flight: requests between their scheduled send and their end, time-averaged per window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from weighbridge.analysis.timeline import FloatArray, covered, per_window, window_edges


@dataclass(frozen=True)
class Windows:
    edges: FloatArray  # window k is [edges[k], edges[k+1])
    service: dict[str, FloatArray]  # tokens served per window
    backlogged_s: dict[str, FloatArray]  # seconds with a request waiting, per window
    in_flight: dict[str, FloatArray]  # time-average requests in flight per window
    ttft_p99_s: dict[str, FloatArray]  # p99 TTFT of requests scheduled in the window (NaN: none)

    @property
    def widths(self) -> FloatArray:
        return np.diff(self.edges)

    @property
    def starts(self) -> FloatArray:
        return self.edges[:-1]

    def backlogged(self, tenant: str, fraction: float) -> np.ndarray:
        """Windows in which ``tenant`` was backlogged for at least ``fraction`` of the window."""
        return self.backlogged_s[tenant] >= fraction * self.widths - 1e-9


def tenant_windows(frame: pd.DataFrame, tenants: list[str], duration_s: float,
                   window_s: float) -> Windows:
    edges = window_edges(duration_s, window_s)
    service: dict[str, FloatArray] = {}
    backlog: dict[str, FloatArray] = {}
    in_flight: dict[str, FloatArray] = {}
    ttft: dict[str, FloatArray] = {}
    groups = {str(k): g for k, g in frame.groupby("tenant", observed=True)}
    empty = frame.iloc[:0]
    for name in tenants:
        g = groups.get(name, empty)
        service[name] = served_tokens(g, edges)
        first = g["first_token_s"].to_numpy()
        end = g["end_s"].to_numpy()
        scheduled = g["scheduled_s"].to_numpy()
        waited_until = np.where(np.isnan(first), end, first)
        backlog[name] = covered(scheduled, waited_until, edges)
        in_flight[name] = per_window(scheduled, end, end - scheduled, edges) / np.diff(edges)
        ttft[name] = _p99_per_window(g, edges)
    return Windows(edges, service, backlog, in_flight, ttft)


def served_tokens(frame: pd.DataFrame, edges: FloatArray) -> FloatArray:
    """Tokens served per window (prompt at the first token, output spread to the last)."""
    first = frame["first_token_s"].to_numpy()
    started = ~np.isnan(first)
    first = first[started]
    last = frame["last_token_s"].to_numpy()[started]
    last = np.where(np.isnan(last), frame["end_s"].to_numpy()[started], last)
    prompt = np.nan_to_num(frame["prompt_tokens"].to_numpy()[started])
    output = np.nan_to_num(frame["output_tokens"].to_numpy()[started])
    return per_window(first, first, prompt, edges) + per_window(first, last, output, edges)


def _p99_per_window(frame: pd.DataFrame, edges: FloatArray) -> FloatArray:
    out = np.full(len(edges) - 1, np.nan)
    ttft = frame["ttft_s"]
    known = ttft.notna().to_numpy()
    if not known.any():
        return out
    at = frame["scheduled_s"].to_numpy()[known]
    k = np.clip(np.searchsorted(edges, at, side="right") - 1, 0, len(edges) - 2)
    p99 = ttft[known].groupby(k).quantile(0.99)
    out[p99.index.to_numpy()] = p99.to_numpy()
    return out
