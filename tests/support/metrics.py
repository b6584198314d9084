"""The tests' reader of the Prometheus text format: one exposition as samples by name, with
the sums and lookups the assertions need. The parsing itself is prometheus_client's
(``text_string_to_metric_families``); the project has no general parser of its own
(``sidecar.scrape.parse_vllm_metrics`` reads only the fields the admission gate needs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support import loopback

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    """One /metrics exposition: sample name -> [(labels, value)]; ``types``: family name ->
    type; ``at_s``: when it was read (monotonic; 0 when it does not matter)."""

    samples: dict[str, list[tuple[dict[str, str], float]]]
    types: dict[str, str] = field(default_factory=dict)
    at_s: float = 0.0
    families: dict[str, list[str]] = field(default_factory=dict)  # family -> sample names

    def label_sets(self, family: str) -> set[Labels]:
        """The label sets of the family's samples (histogram buckets keep their ``le``)."""
        return {frozenset(got.items()) for name in self.families.get(family, ())
                for got, _ in self.samples.get(name, ())}

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        return sum(value for got, value in self.samples.get(name, ())
                   if all(got.get(k) == v for k, v in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        return any(all(got.get(k) == v for k, v in labels.items())
                   for got, _ in self.samples.get(name, ()))

    def value(self, name: str, **labels: str) -> float:
        """The one sample named ``name`` with exactly ``labels``; KeyError when absent."""
        for got, value in self.samples.get(name, ()):
            if got == labels:
                return value
        raise KeyError(f"{name}{labels} not in the exposition")

    def values(self, name: str) -> dict[Labels, float]:
        """Every sample named ``name``, by its label set."""
        return {frozenset(got.items()): value for got, value in self.samples.get(name, ())}

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Sum of the samples named ``name`` per value of ``label``."""
        out: dict[str, float] = {}
        for got, value in self.samples.get(name, ()):
            if all(got.get(k) == v for k, v in labels.items()) and label in got:
                out[got[label]] = out.get(got[label], 0.0) + value
        return out


def parse(text: str, at_s: float = 0.0) -> Scrape:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    types: dict[str, str] = {}
    families: dict[str, list[str]] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        names = families.setdefault(family.name, [])
        for sample in family.samples:
            if sample.name not in names:
                names.append(sample.name)
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Scrape(samples, types, at_s, families)


def scrape(url: str) -> Scrape:
    """GET ``url``/metrics (blocking)."""
    response = loopback.get(url.rstrip("/") + "/metrics", timeout=5)
    response.raise_for_status()
    return parse(response.text, time.monotonic())


async def scrape_async(session: aiohttp.ClientSession, url: str) -> Scrape:
    async with session.get(url.rstrip("/") + "/metrics",
                           timeout=aiohttp.ClientTimeout(total=5)) as response:
        response.raise_for_status()
        text = await response.text()
    return parse(text, time.monotonic())
