"""The report's numbers, computed once from a run, and their ``summary.json`` form.

``summary.json`` keys are a contract (docs/analysis.md): ``run``, ``tenants.<name>.*``,
``tiers.<name>.*``, ``fairness.*``, ``isolation`` (when the run has phases),
``littles_law.<tenant>.*``, ``stability.*``, ``prefix_cache.*``, ``models.<name>.*`` (when
the records name two or more models), ``programs.tenants.<name>.*`` and
``programs.computed_tokens_jain_index`` (when the records name agent programs). Non-finite
numbers are written as null.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from weighbridge.analysis.fairness import Fairness, fairness
from weighbridge.analysis.frame import Run
from weighbridge.analysis.isolation import Isolation, isolation
from weighbridge.analysis.littles_law import LittlesLaw, per_tenant
from weighbridge.analysis.models import ModelStats, model_stats
from weighbridge.analysis.programs import Programs, ProgramStats, programs
from weighbridge.analysis.slo import TierStats, tier_stats
from weighbridge.analysis.stability import Stability, stability
from weighbridge.analysis.tenants import (
    TenantStats,
    tenant_order,
    tenant_stats,
    tenant_tier,
    tenant_weight,
)
from weighbridge.analysis.windows import Windows, tenant_windows

DEFAULT_WINDOW_S = 10.0
DEFAULT_BACKLOG_FRACTION = 0.9


@dataclass(frozen=True)
class Analysis:
    run: Run
    window_s: float
    tenants: dict[str, TenantStats]
    tiers: dict[str, TierStats]
    windows: Windows
    fairness: Fairness
    isolation: Isolation | None
    littles_law: dict[str, LittlesLaw]
    stability: Stability
    models: dict[str, ModelStats]  # empty unless the records name two or more models
    programs: Programs | None  # None unless the records name agent programs


def analyse(run: Run, window_s: float = DEFAULT_WINDOW_S,
            backlog_fraction: float = DEFAULT_BACKLOG_FRACTION) -> Analysis:
    frame, info = run.frame, run.info
    names = tenant_order(frame, info)
    tiers_of = {n: tenant_tier(frame, info, n) for n in names}
    weights = {n: tenant_weight(info, n) for n in names}
    windows = tenant_windows(frame, names, run.duration_s, window_s)
    backlogged = {n: windows.backlogged(n, backlog_fraction) for n in names}
    tenants = tenant_stats(frame, info)
    return Analysis(
        run=run,
        window_s=window_s,
        tenants=tenants,
        tiers=tier_stats(frame, info, run.duration_s),
        windows=windows,
        fairness=fairness(windows.edges, windows.service, backlogged, weights, tiers_of,
                          backlog_fraction, window_s),
        isolation=isolation(frame, info),
        littles_law=per_tenant(frame, names, run.duration_s),
        stability=stability(frame, run.duration_s, info.options),
        models=model_stats(frame, run.duration_s),
        programs=programs(frame, tenants, run.duration_s),
    )


def summary(a: Analysis) -> dict[str, Any]:
    info = a.run.info
    out: dict[str, Any] = {
        "run": {
            "run_id": info.run_id,
            "scenario": info.scenario,
            "started_at": info.started_at.isoformat(),
            "target": info.target,
            "git_commit": info.git_commit,
            "duration_s": a.run.duration_s,
            "records": a.run.records,
            "window_s": a.window_s,
            "path": str(a.run.path),
        },
        "tenants": {n: _tenant(t) for n, t in a.tenants.items()},
        "tiers": {n: _tier(t) for n, t in a.tiers.items()},
        "fairness": _fairness(a.fairness),
        "littles_law": {n: _littles_law(v) for n, v in a.littles_law.items()},
        "prefix_cache": _prefix_cache(a.tenants.values()),
        "stability": {
            "offered_tokens_per_s": a.stability.offered_tokens_per_s,
            "served_tokens_per_s": a.stability.served_tokens_per_s,
            "stability_ratio": a.stability.ratio,
            "stable": a.stability.stable,
            "utilisation": a.stability.utilisation,
            "utilisation_by_backend": a.stability.utilisation_by_backend,
        },
    }
    if a.models:
        out["models"] = {n: _model(m) for n, m in a.models.items()}
    if a.programs is not None:
        out["programs"] = {
            "tenants": {n: _programs(p) for n, p in a.programs.tenants.items()},
            "computed_tokens_jain_index": a.programs.computed_tokens_jain_index,
        }
    if a.isolation is not None:
        i = a.isolation
        out["isolation"] = {
            "victim": i.victim, "victim_from": i.victim_from,
            "flood_phase": i.flood_phase, "quiet_phase": i.quiet_phase,
            "flood_ttft_p99_s": i.flood_ttft_p99_s, "quiet_ttft_p99_s": i.quiet_ttft_p99_s,
            "flood_requests": i.flood_requests, "quiet_requests": i.quiet_requests,
            "flood_over_quiet": i.flood_over_quiet, "leakage": i.leakage,
        }
    safe: dict[str, Any] = json_safe(out)
    return safe


def _tenant(t: TenantStats) -> dict[str, Any]:
    return {
        "tier": t.tier, "weight": t.weight, "requests": t.requests, "ok": t.ok,
        "rejected": t.rejected, "failed": t.failed, "cancelled": t.cancelled,
        "by_status": t.by_status,
        "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
        "ttft_p50_s": t.ttft.p50, "ttft_p90_s": t.ttft.p90, "ttft_p99_s": t.ttft.p99,
        "ttft_p999_s": t.ttft.p999,
        "e2e_p50_s": t.e2e.p50, "e2e_p90_s": t.e2e.p90, "e2e_p99_s": t.e2e.p99,
        "e2e_p999_s": t.e2e.p999,
        "itl_p50_s": t.itl_p50.p50, "itl_p90_s": t.itl_p99.p90, "itl_p99_s": t.itl_p99.p99,
        "itl_p999_s": t.itl_p99.p999,
        "decode_tps_p50": t.decode_tps.p50,
        "rejections": t.rejections,
        "computed_prompt_tokens": t.computed_prompt_tokens,
        "computed_tokens": t.computed_tokens,
        "cached_prompt_tokens": t.cached_prompt_tokens,
        "prefix_cache_hit_rate": t.prefix_cache_hit_rate,
    }


def _prefix_cache(tenants: Iterable[TenantStats]) -> dict[str, Any]:
    """The run's prompt tokens computed and cached, over the tenants' reporting requests."""
    reporting = [t for t in tenants if t.cached_prompt_tokens is not None]
    if not reporting:
        return {"computed_prompt_tokens": None, "cached_prompt_tokens": None,
                "prefix_cache_hit_rate": None}
    cached = sum(t.cached_prompt_tokens or 0 for t in reporting)
    prompt = sum(t.reported_prompt_tokens for t in reporting)
    return {"computed_prompt_tokens": prompt - cached, "cached_prompt_tokens": cached,
            "prefix_cache_hit_rate": cached / prompt if prompt else None}


def _model(m: ModelStats) -> dict[str, Any]:
    return {
        "requests": m.requests, "ok": m.ok, "rejected": m.rejected, "failed": m.failed,
        "cancelled": m.cancelled, "by_status": m.by_status,
        "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
        "ttft_p50_s": m.ttft.p50, "ttft_p99_s": m.ttft.p99,
        "output_tokens_per_s": m.output_tokens_per_s, "token_share": m.token_share,
        "rejections": m.rejections,
    }


def _programs(p: ProgramStats) -> dict[str, Any]:
    v = p.littles_law
    return {
        "programs": p.programs, "programs_completed": p.completed,
        "programs_failed": p.failed, "programs_unfinished": p.unfinished,
        "subagents": p.subagents,
        "completion_p50_s": p.completion.p50, "completion_p90_s": p.completion.p90,
        "completion_p99_s": p.completion.p99, "completion_p999_s": p.completion.p999,
        "programs_in_progress": v.in_flight, "programs_per_s": v.arrival_rate,
        "program_time_in_system_s": v.time_in_system_s, "program_ratio": v.request_ratio,
    }


def _tier(t: TierStats) -> dict[str, Any]:
    return {
        "rank": t.rank, "ttft_slo_s": t.ttft_slo_s, "e2e_slo_s": t.e2e_slo_s,
        "requests": t.requests, "judged": t.judged, "met": t.met,
        "ttft_p50_s": t.ttft.p50, "ttft_p90_s": t.ttft.p90, "ttft_p99_s": t.ttft.p99,
        "ttft_p999_s": t.ttft.p999, "e2e_p50_s": t.e2e.p50, "e2e_p99_s": t.e2e.p99,
        "slo_attainment": t.slo_attainment, "goodput_tokens_per_s": t.goodput_tokens_per_s,
    }


def _fairness(f: Fairness) -> dict[str, Any]:
    return {
        "jain_index": f.jain_index,
        "max_min_share_ratio": f.max_min_share_ratio,
        "max_service_difference": f.max_service_difference,
        "backlog_fraction": f.fraction,
        "tiers": {
            name: {
                "tenants": list(t.tenants),
                "jain_index": t.jain_index,
                "max_min_share_ratio": t.max_min_share_ratio,
                "max_service_difference": t.max_service_difference,
                "service_over_entitlement": t.service_ratio,
                "starved": list(t.starved),
                "judged_windows": t.judged_windows,
                "windows": [
                    {"start_s": w.start_s, "end_s": w.end_s, "backlogged": list(w.backlogged),
                     "jain_index": w.jain_index, "share_ratio": w.share_ratio,
                     "service_difference": w.service_difference}
                    for w in t.windows
                ],
            }
            for name, t in f.tiers.items()
        },
    }


def _littles_law(v: LittlesLaw) -> dict[str, Any]:
    return {
        "arrivals": v.arrivals, "in_flight": v.in_flight, "arrival_rate": v.arrival_rate,
        "time_in_system_s": v.time_in_system_s, "request_ratio": v.request_ratio,
        "tokens_in_flight": v.tokens_in_flight, "token_arrival_rate": v.token_arrival_rate,
        "token_time_in_system_s": v.token_time_in_system_s, "token_ratio": v.token_ratio,
    }


def json_safe(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
