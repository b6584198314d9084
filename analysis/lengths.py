"""Measured prompt and output lengths per tenant and endpoint, as histograms the load
generator's ``empirical`` length distribution reads.

The format (one distribution)::

    {"kind": "empirical", "bins": [[lo, hi, weight], ...]}

Bin ``[lo, hi)`` holds integer token counts ``lo <= n < hi``; a draw picks a bin with
probability ``weight / sum(weights)``, then a count uniformly among its integers. Bins are
sorted, disjoint and non-empty; weights are the request counts. Up to ``MAX_BINS`` distinct
values get a bin each (exact); beyond, bin edges sit at quantiles of the values so every bin
holds about the same number of requests, which keeps the tail's resolution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

MAX_BINS = 32


def histogram(values: npt.ArrayLike, max_bins: int = MAX_BINS) -> dict[str, Any] | None:
    """The empirical distribution of non-negative integer ``values`` (NaN left out)."""
    v = np.asarray(values, dtype=np.float64)
    v = np.rint(v[~np.isnan(v)]).astype(np.int64)
    if v.size == 0:
        return None
    distinct, counts = np.unique(v, return_counts=True)
    if distinct.size <= max_bins:
        bins = [[int(x), int(x) + 1, int(c)] for x, c in zip(distinct, counts, strict=True)]
        return {"kind": "empirical", "bins": bins}
    edges = np.unique(np.floor(np.quantile(v, np.linspace(0, 1, max_bins + 1))).astype(np.int64))
    edges[-1] = distinct[-1] + 1  # the last bin is half-open too, so it must pass the max
    counts, _ = np.histogram(v, bins=edges)
    bins = [[int(lo), int(hi), int(c)]
            for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True) if c]
    return {"kind": "empirical", "bins": bins}


def length_histograms(frame: pd.DataFrame) -> dict[str, dict[str, dict[str, Any]]]:
    """``{tenant: {endpoint: {"requests", "prompt_tokens", "output_tokens"}}}``: prompts of
    every request with a known prompt size, outputs of the ok requests (a cut-off output
    is not a length the workload asked for)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ok = frame["status"] == "ok"
    for (tenant, endpoint), g in frame.groupby(["tenant", "endpoint"], observed=True):
        mine = ok[g.index]
        out.setdefault(str(tenant), {})[str(endpoint)] = {
            "requests": len(g),
            "prompt_tokens": histogram(g["prompt_tokens"].to_numpy()),
            "output_tokens": histogram(g.loc[mine, "output_tokens"].to_numpy()),
        }
    return out
