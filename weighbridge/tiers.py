"""The default tiers, declared once: the sidecar's configuration schema (config.Tier) and the
run directory's record of a run (rundir.TierInfo) both derive theirs from this table, so
that neither imports the other (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_TIERS", "TierDefaults"]


@dataclass(frozen=True)
class TierDefaults:
    rank: int  # lower rank is served first, strictly
    vllm_priority: int = 0
    ttft_slo_ms: float | None = None
    e2e_slo_ms: float | None = None


DEFAULT_TIERS: dict[str, TierDefaults] = {
    "interactive": TierDefaults(rank=1, ttft_slo_ms=500, vllm_priority=0),
    "standard": TierDefaults(rank=2, e2e_slo_ms=10_000, vllm_priority=5),
    "batch": TierDefaults(rank=3, vllm_priority=10),
}
