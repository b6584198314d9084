"""The unit of every number the report prints, declared per summary.json key.

A key's unit is looked up here, never guessed from its name: ``goodput_tokens_per_s`` ends in
``_s`` like ``ttft_p99_s`` but is a rate, not a duration (it was once printed x1000 as
milliseconds). A key without a declared unit is an error, so a new figure cannot reach a
table with a wrong unit; ``tests/unit/analysis/test_units.py`` covers every unit.
"""

from __future__ import annotations

from dataclasses import dataclass

DASH = "—"
TIMES = "\u00d7"  # the times sign of "1.5 times", escaped: ruff flags the literal
MINUS = "\u2212"


@dataclass(frozen=True, slots=True)
class Unit:
    """How a value stored in summary.json (SI: seconds, fractions) is shown."""

    name: str  # "ms", "tok/s", ...: the label next to the number ("" for plain numbers)
    scale: float = 1.0  # shown = stored * scale
    kind: str = "number"  # number | count | percent | ratio

    def format(self, x: float | None) -> str:
        """The value in this unit, without its label; None is the caller's to explain."""
        if x is None:
            return DASH
        v = x * self.scale
        if self.kind == "count":
            return f"{v:,.0f}"
        if self.kind == "percent":
            return f"{v:.1f}"
        if self.kind == "ratio":
            return f"{v:.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return number(v)

    def with_label(self, x: float | None) -> str:
        text = self.format(x)
        if x is None or not self.name:
            return text
        return f"{text}{self.name}" if self.name in ("%", TIMES) else f"{text} {self.name}"

    def format_difference(self, d: float | None) -> str:
        """A difference of two values in this unit, signed; of percentages, in points."""
        if d is None:
            return DASH
        sign = "+" if d > 0 else MINUS if d < 0 else ""
        if self.kind == "percent":
            return f"{sign}{self.format(abs(d))} pp"
        return sign + self.with_label(abs(d))


def number(v: float) -> str:
    """Three significant digits below 1,000, whole numbers with separators above."""
    if float(v).is_integer() and abs(v) >= 1:
        return f"{int(v):,}"
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


MILLISECONDS = Unit("ms", scale=1000.0)  # stored in seconds
TOKENS_PER_S = Unit("tok/s")
TOKENS = Unit("tokens", kind="count")
REQUESTS = Unit("requests", kind="count")
PERCENT = Unit("%", scale=100.0, kind="percent")  # stored as a fraction
INDEX = Unit("")  # dimensionless: Jain's index, leakage
RATIO = Unit(TIMES, kind="ratio")  # this over that
WEIGHTED_TOKENS = Unit("tokens/weight")  # weight-normalised service (VTC)
REQUESTS_PER_S = Unit("req/s")
SECONDS = Unit("s")  # an agent program's times: seconds to minutes
PROGRAMS = Unit("programs", kind="count")
PROGRAMS_PER_S = Unit("programs/s")

# summary.json's key (the last segment of its path) -> its unit.
UNITS: dict[str, Unit] = {
    # tenants and tiers
    "requests": REQUESTS, "ok": REQUESTS, "rejected": REQUESTS, "failed": REQUESTS,
    "cancelled": REQUESTS, "judged": REQUESTS, "met": REQUESTS,
    "prompt_tokens": TOKENS, "output_tokens": TOKENS,
    "computed_prompt_tokens": TOKENS, "cached_prompt_tokens": TOKENS,
    "prefix_cache_hit_rate": PERCENT,
    **{f"{m}_{q}_s": MILLISECONDS for m in ("ttft", "e2e", "itl")
       for q in ("p50", "p90", "p99", "p999")},
    "ttft_slo_s": MILLISECONDS, "e2e_slo_s": MILLISECONDS,
    "decode_tps_p50": TOKENS_PER_S,
    "slo_attainment": PERCENT,
    "goodput_tokens_per_s": TOKENS_PER_S,
    # fairness
    "jain_index": INDEX, "max_min_share_ratio": RATIO,
    "max_service_difference": WEIGHTED_TOKENS,
    # isolation
    "quiet_ttft_p99_s": MILLISECONDS, "flood_ttft_p99_s": MILLISECONDS, "leakage": INDEX,
    "flood_over_quiet": RATIO,
    # Little's Law
    "arrivals": REQUESTS, "in_flight": INDEX, "arrival_rate": REQUESTS_PER_S,
    "time_in_system_s": MILLISECONDS, "request_ratio": INDEX,
    "tokens_in_flight": INDEX, "token_arrival_rate": TOKENS_PER_S,
    "token_time_in_system_s": MILLISECONDS, "token_ratio": INDEX,
    # stability
    "offered_tokens_per_s": TOKENS_PER_S, "served_tokens_per_s": TOKENS_PER_S,
    "stability_ratio": INDEX, "utilisation": INDEX,
    # models
    "output_tokens_per_s": TOKENS_PER_S, "token_share": PERCENT,
    # agent programs
    "programs": PROGRAMS, "programs_completed": PROGRAMS, "programs_failed": PROGRAMS,
    "programs_unfinished": PROGRAMS, "subagents": PROGRAMS,
    **{f"completion_{q}_s": SECONDS for q in ("p50", "p90", "p99", "p999")},
    "programs_in_progress": INDEX, "programs_per_s": PROGRAMS_PER_S,
    "program_time_in_system_s": SECONDS, "program_ratio": INDEX,
    "computed_tokens": TOKENS, "computed_tokens_jain_index": INDEX,
}


def unit_of(path: str) -> Unit:
    """The declared unit of a dotted summary.json path (its last segment's); KeyError when
    none is declared. Names of tenants and tiers may hold dots, keys never do."""
    key = path.rsplit(".", 1)[-1]
    try:
        return UNITS[key]
    except KeyError:
        raise KeyError(f"no unit declared for {path!r} (analysis/units.py)") from None
