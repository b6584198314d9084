"""A labelled histogram that takes weighted observations, for distributions the generator only
knows in aggregate per request.

The inter-token latency is the case: a record carries a request's first and last token times
and its chunk count, not each gap, so a request adds ``chunks - 1`` observations at its mean
gap. ``_count`` and ``_sum`` are then exact (every gap, their total time); only the spread of
gaps *within* one request is lost from the buckets. Observing the mean ``chunks - 1`` times
through ``prometheus_client.Histogram`` would cost one call per token.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["WeightedHistogram"]


@dataclass(slots=True)
class _Series:
    counts: list[int]  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0


@dataclass(slots=True)
class WeightedHistogram:
    name: str  # without the _bucket/_sum/_count suffixes
    documentation: str
    labelnames: Sequence[str]
    buckets: Sequence[float]
    _series: dict[tuple[str, ...], _Series] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(set(self.buckets)) or not self.buckets:
            raise ValueError(f"{self.name}: buckets must be strictly increasing")

    def touch(self, labels: Sequence[str]) -> None:
        """Create the series (all zero) so it is exported before its first observation."""
        self._get(tuple(labels))

    def observe(self, labels: Sequence[str], value: float, count: int = 1) -> None:
        if count <= 0:
            return
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{self.name}: value must be finite and >= 0, got {value}")
        series = self._get(tuple(labels))
        series.counts[bisect.bisect_left(self.buckets, value)] += count
        series.total += value * count

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation,
                                       labels=list(self.labelnames))
        for labels, series in self._series.items():
            cumulative, buckets = 0, []
            for bound, count in zip([*self.buckets, math.inf], series.counts, strict=True):
                cumulative += count
                # prometheus_client.utils has no annotations.
                le = floatToGoString(bound)  # type: ignore[no-untyped-call]
                buckets.append((le, cumulative))
            family.add_metric(list(labels), buckets, series.total)
        return family

    def _get(self, labels: tuple[str, ...]) -> _Series:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {list(self.labelnames)}")
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series([0] * (len(self.buckets) + 1))
        return series
