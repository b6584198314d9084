"""Per-tenant figures: requests by status, tokens, latency percentiles, decode speed,
rejections by reason, and the prompt tokens the server's prefix cache supplied.

Prompt tokens **cached** are the sum of usage's ``prompt_tokens_details.cached_tokens``;
**computed** are the prompt tokens of the same requests less those; the **hit rate** is cached
over both. All three count only the requests whose server reported cached tokens (vLLM with
``--enable-prompt-tokens-details``), and are undefined when none did."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from weighbridge.analysis.percentiles import Percentiles, by_group
from weighbridge.rundir import RunInfo

FAILED = ("error", "timeout")  # the server's or the network's fault; cancelled is the client's


@dataclass(frozen=True)
class TenantStats:
    name: str
    tier: str
    weight: float
    requests: int
    by_status: dict[str, int]
    prompt_tokens: int  # served: from usage of the requests that have it
    output_tokens: int
    ttft: Percentiles  # requests that got a first token, any status
    e2e: Percentiles  # ok requests
    itl_p50: Percentiles  # over requests, of each request's median inter-token latency
    itl_p99: Percentiles  # over requests, of each request's p99 inter-token latency
    decode_tps: Percentiles  # requests with >= 2 output tokens over a positive span
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count
    # Of the requests that reported cached tokens: their prompt tokens, and the cached part
    # (None: no request reported it).
    reported_prompt_tokens: int = 0
    cached_prompt_tokens: int | None = None

    @property
    def computed_prompt_tokens(self) -> int | None:
        if self.cached_prompt_tokens is None:
            return None
        return self.reported_prompt_tokens - self.cached_prompt_tokens

    @property
    def computed_tokens(self) -> int:
        """The tokens the server computed for the tenant: its output, and its prompt tokens
        but those its prefix cache answered (all of them where it reported none)."""
        return self.prompt_tokens - (self.cached_prompt_tokens or 0) + self.output_tokens

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.cached_prompt_tokens is None or not self.reported_prompt_tokens:
            return None
        return self.cached_prompt_tokens / self.reported_prompt_tokens

    @property
    def ok(self) -> int:
        return self.by_status.get("ok", 0)

    @property
    def rejected(self) -> int:
        return self.by_status.get("rejected", 0)

    @property
    def failed(self) -> int:
        return sum(self.by_status.get(s, 0) for s in FAILED)

    @property
    def cancelled(self) -> int:
        return self.by_status.get("cancelled", 0)


def tenant_order(frame: pd.DataFrame, info: RunInfo) -> list[str]:
    """run.json's tenants in their order, then any tenant only the records name."""
    names = [t.name for t in info.tenants]
    seen = set(names)
    extra = sorted(str(t) for t in frame["tenant"].unique() if str(t) not in seen)
    return names + extra


def tenant_tier(frame: pd.DataFrame, info: RunInfo, name: str) -> str:
    """run.json's tier of the tenant, else the tier most of its requests used."""
    if (tenant := info.tenant(name)) is not None:
        return tenant.tier
    tiers = frame.loc[frame["tenant"] == name, "tier"].value_counts()
    return str(tiers.index[0]) if len(tiers) else "unknown"


def tenant_weight(info: RunInfo, name: str) -> float:
    tenant = info.tenant(name)
    return tenant.weight if tenant is not None else 1.0


def tenant_stats(frame: pd.DataFrame, info: RunInfo) -> dict[str, TenantStats]:
    tenant = frame["tenant"]
    status_counts = frame.groupby(["tenant", "status"], observed=True).size()
    tokens = frame.groupby("tenant", observed=True)[["prompt_tokens", "output_tokens"]].sum()
    cache = prefix_cache(frame, "tenant")
    rejected = frame[frame["status"] == "rejected"]
    reasons = rejected.groupby(["tenant", "reason"], observed=True).size()
    ok = frame["status"] == "ok"
    ttft = by_group(frame["ttft_s"], tenant)
    e2e = by_group(frame["e2e_s"].where(ok), tenant)
    itl50 = by_group(frame["itl_p50_s"], tenant)
    itl99 = by_group(frame["itl_p99_s"], tenant)
    tps = by_group(frame["decode_tps"], tenant)
    empty = Percentiles.of([])
    out: dict[str, TenantStats] = {}
    for name in tenant_order(frame, info):
        statuses = _level(status_counts, name)
        out[name] = TenantStats(
            name=name,
            tier=tenant_tier(frame, info, name),
            weight=tenant_weight(info, name),
            requests=sum(statuses.values()),
            by_status=statuses,
            prompt_tokens=int(tokens["prompt_tokens"].get(name, 0)),
            output_tokens=int(tokens["output_tokens"].get(name, 0)),
            ttft=ttft.get(name, empty),
            e2e=e2e.get(name, empty),
            itl_p50=itl50.get(name, empty),
            itl_p99=itl99.get(name, empty),
            decode_tps=tps.get(name, empty),
            rejections=_level(reasons, name),
            **cache.get(name, {}),
        )
    return out


def prefix_cache(frame: pd.DataFrame, by: str) -> dict[str, dict[str, int]]:
    """Per group: ``reported_prompt_tokens`` and ``cached_prompt_tokens`` of the requests
    that reported cached tokens (groups where none did are left out)."""
    reported = frame[frame["cached_tokens"].notna() & frame["prompt_tokens"].notna()]
    sums = reported.groupby(by, observed=True)[["prompt_tokens", "cached_tokens"]].sum()
    counts = reported.groupby(by, observed=True).size()
    return {str(k): {"reported_prompt_tokens": int(sums.loc[k, "prompt_tokens"]),
                     "cached_prompt_tokens": int(sums.loc[k, "cached_tokens"])}
            for k in sums.index if counts.get(k, 0)}


def _level(counts: pd.Series, name: str) -> dict[str, int]:
    if name not in counts.index.get_level_values(0):
        return {}
    return {str(k): int(v) for k, v in counts.xs(name, level=0).items() if v}
