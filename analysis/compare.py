"""Two runs side by side (``--baseline``): the headline numbers of each and their difference.

``difference = this - baseline``; ``relative = difference / |baseline|`` (null when the
baseline is 0 or either side is missing). Rows are the union of both runs' tenants and tiers
(and models, when either run breaks its figures down by model; agent programs, when either
run's requests are their calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weighbridge.analysis.gate import resolve

TENANT_KEYS = ("requests", "ok", "rejected", "failed", "prompt_tokens", "output_tokens",
               "computed_tokens", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "itl_p99_s",
               "decode_tps_p50", "computed_prompt_tokens", "cached_prompt_tokens",
               "prefix_cache_hit_rate")
PREFIX_CACHE_KEYS = ("computed_prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate")
TIER_KEYS = ("requests", "ttft_p50_s", "ttft_p99_s", "slo_attainment", "goodput_tokens_per_s")
FAIRNESS_KEYS = ("jain_index", "max_min_share_ratio", "max_service_difference")
ISOLATION_KEYS = ("quiet_ttft_p99_s", "flood_ttft_p99_s", "flood_over_quiet", "leakage")
STABILITY_KEYS = ("offered_tokens_per_s", "served_tokens_per_s", "stability_ratio",
                  "utilisation")
MODEL_KEYS = ("requests", "ok", "rejected", "failed", "ttft_p50_s", "ttft_p99_s",
              "output_tokens_per_s", "token_share")
PROGRAM_KEYS = ("programs", "programs_completed", "programs_failed", "completion_p50_s",
                "completion_p90_s", "completion_p99_s", "programs_in_progress",
                "program_time_in_system_s")


@dataclass(frozen=True, slots=True)
class Difference:
    path: str
    this: float | None
    baseline: float | None

    @property
    def difference(self) -> float | None:
        if self.this is None or self.baseline is None:
            return None
        return self.this - self.baseline

    @property
    def relative(self) -> float | None:
        d = self.difference
        if d is None or not self.baseline:
            return None
        return d / abs(self.baseline)


def headline_paths(this: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    paths = [f"fairness.{k}" for k in FAIRNESS_KEYS]
    for section, keys in (("tiers", TIER_KEYS), ("tenants", TENANT_KEYS),
                          ("models", MODEL_KEYS)):
        names = list(this.get(section, {}))
        names += [n for n in baseline.get(section, {}) if n not in names]
        paths += [f"{section}.{n}.{k}" for n in names for k in keys]
    programs = [*this.get("programs", {}).get("tenants", {})]
    programs += [n for n in baseline.get("programs", {}).get("tenants", {})
                 if n not in programs]
    paths += [f"programs.tenants.{n}.{k}" for n in programs for k in PROGRAM_KEYS]
    if "programs" in this or "programs" in baseline:
        paths.append("programs.computed_tokens_jain_index")
    if "isolation" in this or "isolation" in baseline:
        paths += [f"isolation.{k}" for k in ISOLATION_KEYS]
    paths += [f"stability.{k}" for k in STABILITY_KEYS]
    paths += [f"prefix_cache.{k}" for k in PREFIX_CACHE_KEYS]
    return paths


def compare(this: dict[str, Any], baseline: dict[str, Any]) -> list[Difference]:
    return [Difference(p, _number(this, p), _number(baseline, p))
            for p in headline_paths(this, baseline)]


def comparison_json(baseline: dict[str, Any], rows: list[Difference]) -> dict[str, Any]:
    return {
        "run": baseline["run"],
        "differences": {r.path: {"this": r.this, "baseline": r.baseline,
                                 "difference": r.difference, "relative": r.relative}
                        for r in rows},
    }


def _number(summary: dict[str, Any], path: str) -> float | None:
    try:
        node = resolve(summary, path)  # names may hold dots: resolve() finds them
    except KeyError:
        return None
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    return float(node)
