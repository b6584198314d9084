"""Reading the emulator's /metrics: counter and histogram deltas between two scrapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]  # "name{sorted labels}" -> value


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    """Sum of every series of ``name`` whose labels include ``match``."""
    want = {f"{k}={v}" for k, v in match.items()}
    result = 0.0
    for key, value in samples.items():
        base, _, labels = key.partition("{")
        if base == name and want <= set(labels.rstrip("}").split(",")):
            result += value
    return result


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    """What a histogram observed between two scrapes (one label set)."""

    count: float
    sum: float
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Prometheus's histogram_quantile: linear within the bucket the rank falls in."""
        if not self.count:
            return math.nan
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                span = cumulative - lower_count
                fraction = (rank - lower_count) / span if span else 1.0
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    def upper_bound(self, q: float) -> float:
        """The smallest bucket bound that holds the q-quantile (a sure upper bound)."""
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return bound
        return math.inf


def histogram_delta(before: Samples, after: Samples, name: str) -> HistogramDelta:
    """The delta of histogram ``name``, summed over label sets other than ``le``."""
    by_bound: dict[float, float] = {}
    for key, value in after.items():
        if not key.startswith(name + "_bucket{"):
            continue
        labels = dict(p.split("=", 1) for p in key[len(name) + 8:-1].split(","))
        bound = float(labels["le"])
        by_bound[bound] = by_bound.get(bound, 0.0) + value - before.get(key, 0.0)
    count = total(after, name + "_count") - total(before, name + "_count")
    sum_ = total(after, name + "_sum") - total(before, name + "_sum")
    return HistogramDelta(count=count, sum=sum_, buckets=sorted(by_bound.items()))
