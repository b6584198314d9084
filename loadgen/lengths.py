"""Token-length distributions for prompts and outputs: seeded, bounded, reproducible.

Every distribution draws a whole number of tokens >= 1 from an injected ``random.Random``
and knows its support (``bounds()``), so a tenant's sizes are reproducible from the seed and
can be checked against the server's limits before a run. Truncation is exact (inverse CDF
over the allowed range), not rejection sampling, so a draw always costs the same.

YAML forms (``kind`` picks the distribution; a bare integer means ``fixed``)::

    128                                            # fixed
    {kind: uniform, low: 16, high: 64}             # inclusive
    {kind: normal, mean: 200, std: 50, low: 1, high: 400}
    {kind: lognormal, median: 300, sigma: 0.6, low: 8, high: 4000}
    {kind: mixture, components: [{weight: 0.8, dist: 32}, {weight: 0.2, dist: 2000}]}
    {kind: empirical, file: prompt_hist.csv}       # bins low,high,count (high exclusive)

A request's prompt and output are drawn together from a :class:`Lengths`: one or more
weighted *classes*, each with its own prompt and output distribution, so "80% short
classifications, 20% long essays" keeps a short prompt with a short answer.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
import random
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    model_validator,
)

__all__ = [
    "Distribution",
    "Empirical",
    "Fixed",
    "HistogramBin",
    "LengthClass",
    "Lengths",
    "LogNormal",
    "Mixture",
    "TruncNormal",
    "Uniform",
]

_T = TypeVar("_T")
# Bounds of an unbounded upper tail: beyond any model's context, so it only guards overflow.
_NO_HIGH = 10_000_000


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fixed(_Model):
    kind: Literal["fixed"] = "fixed"
    value: PositiveInt

    def sample(self, rng: random.Random) -> int:
        return self.value

    def bounds(self) -> tuple[int, int]:
        return self.value, self.value

    def mean(self) -> float:
        return float(self.value)


class Uniform(_Model):
    kind: Literal["uniform"] = "uniform"
    low: PositiveInt
    high: PositiveInt  # inclusive

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def mean(self) -> float:
        return (self.low + self.high) / 2


def _truncated(rng: random.Random, dist: NormalDist, lo: float, hi: float) -> float:
    """A draw of ``dist`` restricted to [lo, hi] by inverting its CDF over that range."""
    c_lo, c_hi = dist.cdf(lo), dist.cdf(hi)
    if c_hi - c_lo < 1e-12:  # the range sits far in one tail: its nearest end is the answer
        return lo if c_lo >= 0.5 else hi
    u = c_lo + rng.random() * (c_hi - c_lo)
    u = min(max(u, 1e-15), 1 - 1e-15)
    return min(max(dist.inv_cdf(u), lo), hi)


class TruncNormal(_Model):
    kind: Literal["normal"] = "normal"
    mean_: float = Field(alias="mean")
    std: PositiveFloat
    low: PositiveInt = 1
    high: PositiveInt = _NO_HIGH

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _ordered(self) -> TruncNormal:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        # Each integer k owns [k - 0.5, k + 0.5), so the bounds carry their full mass.
        x = _truncated(rng, NormalDist(self.mean_, self.std), self.low - 0.5, self.high + 0.5)
        return min(max(round(x), self.low), self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def mean(self) -> float:
        return min(max(self.mean_, self.low), self.high)  # close enough for sizing


class LogNormal(_Model):
    kind: Literal["lognormal"] = "lognormal"
    median: PositiveFloat
    sigma: PositiveFloat  # of the underlying normal: 0.5 is a factor of ~1.65 either way
    low: PositiveInt = 1
    high: PositiveInt = _NO_HIGH

    @model_validator(mode="after")
    def _ordered(self) -> LogNormal:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        dist = NormalDist(math.log(self.median), self.sigma)
        lo = math.log(max(self.low - 0.5, 0.5))
        hi = math.log(self.high + 0.5)
        return min(max(round(math.exp(_truncated(rng, dist, lo, hi))), self.low), self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def mean(self) -> float:
        return min(max(self.median * math.exp(self.sigma**2 / 2), self.low), self.high)


class HistogramBin(_Model):
    """``{low, high, count}``, or ``[low, high, count]`` as `weighbridge report` writes it."""

    low: NonNegativeInt  # a bin at 0 is drawn as 1: a prompt or output has at least one token
    high: PositiveInt  # exclusive
    count: float = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_triple(cls, data: Any) -> Any:
        if isinstance(data, list | tuple):
            if len(data) != 3:
                raise ValueError(f"a bin is [low, high, count], got {list(data)!r}")
            return {"low": data[0], "high": data[1], "count": data[2]}
        return data

    @model_validator(mode="after")
    def _ordered(self) -> HistogramBin:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be > low ({self.low})")
        return self


def _read_histogram(path: Path, select: tuple[str, str, str] | None = None) -> list[Any]:
    """Bins from a CSV (header ``low,high,count``) or JSON (``{"bins": [...]}``) file, or from
    the ``lengths.json`` of `weighbridge report` (``{"lengths": {tenant: {endpoint: {measure:
    {"kind": "empirical", "bins": [[low, high, count], ...]}}}}}``), where ``select`` names
    the tenant, endpoint and measure (``prompt_tokens`` or ``output_tokens``)."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "lengths" in data:
            if select is None:
                raise ValueError("a report's lengths.json needs tenant, endpoint and measure")
            tenant, endpoint, measure = select
            try:
                data = data["lengths"][tenant][endpoint][measure]
            except KeyError:
                raise ValueError(f"no {measure} histogram for tenant {tenant!r} on "
                                 f"{endpoint} in it") from None
        bins = data["bins"] if isinstance(data, dict) else data
        return list(bins)
    with path.open(newline="") as file:
        return [
            {"low": int(row["low"]), "high": int(row["high"]), "count": float(row["count"])}
            for row in csv.DictReader(file)
        ]


class Empirical(_Model):
    """Sizes from a histogram (the form the analysis exports): a bin is picked with
    probability proportional to its count, then a size uniformly inside it."""

    kind: Literal["empirical"] = "empirical"
    file: str | None = None  # relative to the tenants file
    # With a report's lengths.json as ``file``: which histogram in it.
    tenant: str | None = None
    endpoint: str | None = None  # e.g. /v1/completions
    measure: Literal["prompt_tokens", "output_tokens"] | None = None
    bins: list[HistogramBin] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _load_file(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and data.get("file") and not data.get("bins"):
            base = Path((info.context or {}).get("base_dir", "."))
            path = Path(data["file"])
            path = path if path.is_absolute() else base / path
            select = None
            if data.get("tenant") and data.get("endpoint") and data.get("measure"):
                select = (data["tenant"], data["endpoint"], data["measure"])
            try:
                data = {**data, "bins": _read_histogram(path, select)}
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"cannot read histogram {path}: {exc}") from None
        return data

    @model_validator(mode="after")
    def _has_mass(self) -> Empirical:
        if not self.bins or sum(b.count for b in self.bins) <= 0:
            raise ValueError("needs at least one bin with a positive count")
        return self

    def sample(self, rng: random.Random) -> int:
        used = self._used()
        chosen = _pick(rng, list(itertools.accumulate(b.count for b in used)), used)
        return max(1, rng.randrange(chosen.low, chosen.high))

    def _used(self) -> list[HistogramBin]:
        # Empty bins left out: a draw that rounds up to the total weight (random() * total
        # can) falls past the last interval and must land on a bin that can be drawn.
        return [b for b in self.bins if b.count > 0]

    def bounds(self) -> tuple[int, int]:
        used = self._used()
        return max(1, min(b.low for b in used)), max(1, max(b.high - 1 for b in used))

    def mean(self) -> float:
        total = sum(b.count for b in self.bins)
        return sum(b.count * (b.low + b.high - 1) / 2 for b in self.bins) / total


def _pick(rng: random.Random, cumulative: list[float], items: list[_T]) -> _T:
    """The item whose cumulative-weight interval holds a uniform draw."""
    x = rng.random() * cumulative[-1]
    return items[min(bisect.bisect_right(cumulative, x), len(items) - 1)]


class Component(_Model):
    weight: PositiveFloat
    dist: Distribution


class Mixture(_Model):
    kind: Literal["mixture"] = "mixture"
    components: list[Component] = Field(min_length=1)

    def sample(self, rng: random.Random) -> int:
        weights = list(itertools.accumulate(c.weight for c in self.components))
        return _pick(rng, weights, self.components).dist.sample(rng)

    def bounds(self) -> tuple[int, int]:
        spans = [c.dist.bounds() for c in self.components]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def mean(self) -> float:
        total = sum(c.weight for c in self.components)
        return sum(c.weight * c.dist.mean() for c in self.components) / total


def _shorthand(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "fixed", "value": value}
    return value


Distribution = Annotated[
    Annotated[
        Fixed | Uniform | TruncNormal | LogNormal | Mixture | Empirical,
        Field(discriminator="kind"),
    ],
    BeforeValidator(_shorthand),
]

Component.model_rebuild()
Mixture.model_rebuild()


class LengthClass(_Model):
    """One kind of request: its share of the tenant's traffic and its two sizes."""

    name: str | None = None
    weight: PositiveFloat = 1.0
    prompt: Distribution
    output: Distribution


class Lengths(_Model):
    """A tenant's request sizes: weighted classes, each a (prompt, output) pair."""

    classes: list[LengthClass] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _single_class(cls, data: Any) -> Any:
        # `{prompt: ..., output: ...}` is the common one-class case.
        if isinstance(data, dict) and "classes" not in data:
            return {"classes": [data]}
        return data

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens) of one request."""
        if len(self.classes) == 1:
            chosen = self.classes[0]
        else:
            weights = list(itertools.accumulate(c.weight for c in self.classes))
            chosen = _pick(rng, weights, self.classes)
        return chosen.prompt.sample(rng), chosen.output.sample(rng)

    def mean_tokens(self) -> tuple[float, float]:
        total = sum(c.weight for c in self.classes)
        return (
            sum(c.weight * c.prompt.mean() for c in self.classes) / total,
            sum(c.weight * c.output.mean() for c in self.classes) / total,
        )

    def max_tokens(self) -> tuple[int, int]:
        return (max(c.prompt.bounds()[1] for c in self.classes),
                max(c.output.bounds()[1] for c in self.classes))
