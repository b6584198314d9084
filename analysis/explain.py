"""Why a figure of the report is undefined, in words, for the place where it would stand.

A bare dash leaves the reader guessing whether it is good news (no two tenants were ever
backlogged together, so there was nothing to share) or a failure (no request got a first
token). Every function here takes the summary.json section the figure lives in and returns
the reason, or None when the figure is defined. The wording is what the report prints.
"""

from __future__ import annotations

from typing import Any

from weighbridge.analysis.units import DASH


def undefined(reason: str) -> str:
    """The cell for an undefined value: the dash and, in place, why."""
    return f"{DASH} ({reason})"


PREFIX_CACHE_KEYS = ("computed_prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate")


def prefix_cache_figure(s: dict[str, Any], key: str) -> str | None:
    """Why a prefix-cache figure (a tenant's or the run's ``prefix_cache``) is null."""
    if s.get(key) is not None:
        return None
    if s.get("cached_prompt_tokens") is None:
        return "the server reported no cached tokens (vLLM: --enable-prompt-tokens-details)"
    return "no prompt tokens"


def tenant_figure(t: dict[str, Any], key: str) -> str | None:
    """Why ``tenants.<name>.<key>`` is null."""
    if t.get(key) is not None:
        return None
    if not t.get("requests"):
        return "no requests"
    if key in PREFIX_CACHE_KEYS:
        return prefix_cache_figure(t, key)
    if key.startswith("ttft_"):
        return f"none of its {t['requests']:,} requests got a first token"
    if not t.get("ok"):
        return "no request completed ok"
    if key.startswith("itl_"):
        return "no completed request streamed two or more tokens"
    if key.startswith("decode_tps"):
        return "no request had two or more output tokens over a positive span"
    return "no request measured it"


def model_figure(m: dict[str, Any], key: str) -> str | None:
    """Why ``models.<name>.<key>`` is null."""
    if m.get(key) is not None:
        return None
    if key == "output_tokens_per_s":
        return "the run has no duration"
    if key == "token_share":
        return "no tokens were served in the run"
    return tenant_figure(m, key)


def tier_figure(t: dict[str, Any], key: str) -> str | None:
    """Why ``tiers.<name>.<key>`` is null."""
    if t.get(key) is not None:
        return None
    if not t.get("requests"):
        return "no requests in this tier"
    if key == "slo_attainment":
        return "every request was cancelled by the client: none judged"
    if key == "goodput_tokens_per_s":
        return "the run has no duration"
    if key.startswith("ttft_"):
        return "no request got a first token"
    return "no request completed ok"


def tier_fairness(t: dict[str, Any], window_s: float, fraction: float) -> str | None:
    """Why a tier's Jain index (and share ratio, service difference) is null."""
    if t.get("jain_index") is not None:
        return None
    if len(t.get("tenants", ())) < 2:
        return "one tenant in this tier: no one to share with"
    if not t.get("judged_windows"):
        return (f"no two of its tenants were backlogged together (waiting ≥ {fraction:.0%} "
                f"of a {window_s:g} s window) in any window: nothing was contended")
    return "the backlogged tenants were served nothing in the contended windows"


def share_ratio(t: dict[str, Any], window_s: float, fraction: float) -> str | None:
    """Why a tier's max/min share ratio is null: as Jain's, or a starved tenant."""
    if t.get("max_min_share_ratio") is not None:
        return None
    if t.get("starved"):
        return f"unbounded: {', '.join(t['starved'])} got nothing while backlogged"
    return tier_fairness(t, window_s, fraction) or "unbounded"


def run_fairness(f: dict[str, Any], window_s: float) -> str | None:
    """Why the run's (worst tier's) fairness is null."""
    if f.get("jain_index") is not None:
        return None
    tiers = f.get("tiers", {})
    if all(len(t.get("tenants", ())) < 2 for t in tiers.values()):
        return "no tier has two tenants"
    return (f"no two tenants of a tier were backlogged together in any {window_s:g} s "
            f"window: nothing was contended")


def run_share_ratio(f: dict[str, Any], window_s: float) -> str | None:
    if f.get("max_min_share_ratio") is not None:
        return None
    starved = [n for t in f.get("tiers", {}).values() for n in t.get("starved", ())]
    if starved:
        return f"unbounded: {', '.join(starved)} got nothing while backlogged"
    return run_fairness(f, window_s) or "unbounded"


def isolation_figure(i: dict[str, Any], key: str) -> str | None:
    """Why ``isolation.<key>`` is null."""
    if i.get(key) is not None:
        return None
    victim = i.get("victim", "the victim")
    quiet, flood = i.get("quiet_ttft_p99_s"), i.get("flood_ttft_p99_s")
    if key == "quiet_ttft_p99_s" or (key != "flood_ttft_p99_s" and quiet is None):
        return f"{victim} got no first token in the {i.get('quiet_phase')} phase"
    if key == "flood_ttft_p99_s" or flood is None:
        return f"{victim} got no first token in the {i.get('flood_phase')} phase"
    if key == "flood_over_quiet":
        return f"{victim}'s quiet p99 TTFT is 0"
    return "undefined"


def littles_law(v: dict[str, Any], key: str) -> str | None:
    if v.get(key) is not None:
        return None
    if not v.get("arrivals"):
        return "no request was scheduled inside the run"
    if key.startswith("token"):
        return "its requests carried no known tokens"
    return "its requests spent no time in the system"


def program_figure(t: dict[str, Any], key: str) -> str | None:
    """Why ``programs.tenants.<name>.<key>`` is null."""
    if t.get(key) is not None:
        return None
    if key.startswith("completion_"):
        return (f"none of its {t['programs']:,} programs completed (failed "
                f"{t['programs_failed']:,}, unfinished at the run's end "
                f"{t['programs_unfinished']:,})")
    if key == "program_time_in_system_s" or key == "program_ratio":
        return "no program started inside the run"
    return "undefined"


def program_fairness(p: dict[str, Any]) -> str | None:
    """Why ``programs.computed_tokens_jain_index`` is null."""
    if p.get("computed_tokens_jain_index") is not None:
        return None
    return "fewer than two tenants sent requests, or the server computed nothing for them"


def stability(st: dict[str, Any], key: str) -> str | None:
    if st.get(key) is not None:
        return None
    if key == "stability_ratio":
        return "nothing was offered or served"
    if key == "utilisation":
        return ("run.json records no step time and budget (options.utilisation: weighbridge "
                "simulate writes them; a live sidecar exports "
                "weighbridge_pool_utilisation_ratio)")
    return "the run has no duration"


def difference(this: float | None, baseline: float | None) -> str | None:
    """Why this - baseline is undefined."""
    if this is not None and baseline is not None:
        return None
    if this is None and baseline is None:
        return "undefined in both runs"
    return "undefined in this run" if this is None else "undefined in the baseline"


def relative(this: float | None, baseline: float | None) -> str | None:
    """Why (this - baseline) / |baseline| is undefined."""
    if this is not None and baseline is not None and baseline != 0:
        return None
    if this is not None and baseline == 0:
        return "the baseline is 0"
    return difference(this, baseline)
