"""Empirical length histograms in the load generator's format."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.support.records import rec, write_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.lengths import histogram, length_histograms


def test_few_distinct_values_get_exact_bins() -> None:
    assert histogram([5, 5, 7, np.nan]) == {"kind": "empirical", "bins": [[5, 6, 2], [7, 8, 1]]}
    assert histogram([]) is None


@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=500), st.integers(2, 40))
def test_bins_are_sorted_disjoint_and_hold_every_value(values: list[int], max_bins: int) -> None:
    h = histogram(values, max_bins=max_bins)
    assert h is not None and h["kind"] == "empirical"
    bins = h["bins"]
    assert len(bins) <= max(max_bins, 1)
    assert sum(w for _, _, w in bins) == len(values)
    assert all(lo < hi for lo, hi, _ in bins)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bins))
    for v in values:  # every value falls in a bin [lo, hi)
        assert any(lo <= v < hi for lo, hi, _ in bins)


def test_per_tenant_and_endpoint_outputs_from_ok_requests(tmp_path: Path) -> None:
    records = [rec("a", output=10), rec("a", output=12),
               rec("a", output=3, status="cancelled"),
               rec("a", endpoint="/v1/chat/completions", prompt=7, output=1),
               rec("b", prompt=None, output=None, status="rejected", ttft=None)]
    run = load_run(write_run(tmp_path, records))
    got = length_histograms(run.frame)
    a = got["a"]["/v1/completions"]
    assert a["requests"] == 3
    assert a["output_tokens"]["bins"] == [[10, 11, 1], [12, 13, 1]]
    assert a["prompt_tokens"]["bins"] == [[10, 11, 3]]
    assert got["a"]["/v1/chat/completions"]["prompt_tokens"]["bins"] == [[7, 8, 1]]
    assert got["b"]["/v1/completions"]["output_tokens"] is None
