"""The demo's headline: the figures it prints, read from a run's summary.json."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from weighbridge.analysis.headline import HeadlineFigures as Headline
from weighbridge.analysis.headline import headline_figures as headline
from weighbridge.app.demo import headline_rows, verdict


def summary(quiet: float | None = 0.05, flood: float | None = 0.5) -> dict[str, Any]:
    return {
        "isolation": {"victim": "victim", "quiet_ttft_p99_s": quiet, "flood_ttft_p99_s": flood},
        "fairness": {"jain_index": 0.8},
        "tiers": {"standard": {"rank": 2, "requests": 10, "slo_attainment": 0.5,
                               "ttft_p99_s": 2.0},
                  "interactive": {"rank": 1, "requests": 10, "slo_attainment": 0.9,
                                  "ttft_p99_s": 0.3}},
        "stability": {"served_tokens_per_s": 1234.5},
    }


def test_headline_reads_the_victim_tier_one_and_throughput() -> None:
    head = headline(summary())
    assert head.victim == "victim"
    assert head.victim_ratio == 10.0
    assert head.tier1 == "interactive"  # the lowest rank, wherever it sits in the mapping
    assert head.tier1_slo_attainment == 0.9 and head.tier1_ttft_p99_s == 0.3
    assert head.jain_index == 0.8 and head.served_tokens_per_s == 1234.5
    assert head.to_json()["victim_ttft_ratio"] == 10.0
    idle = summary()
    idle["tiers"]["interactive"]["requests"] = 0
    assert headline(idle).tier1 == "standard"  # tier 1 is the best tier that had requests


def test_missing_figures_are_none_and_print_as_a_dash() -> None:
    empty = headline({})
    assert empty == Headline(None, None, None, None, None, None, None, None)
    assert empty.victim_ratio is None
    for _, base, _fair in headline_rows(empty, headline(summary(flood=None))):
        assert base == "—"
    assert "missing" in verdict(empty, empty)


def test_verdict_says_which_run_protected_the_victim() -> None:
    base, fair = headline(summary(0.05, 3.0)), headline(summary(0.05, 0.1))
    assert "60.0x through the request-level baseline and by 2.0x" in verdict(base, fair)
    assert "did not help" in verdict(fair, base)


figures = st.one_of(st.none(), st.floats(min_value=0, max_value=1e6),
                    st.just(math.nan), st.just(math.inf), st.booleans())


@given(quiet=figures, flood=figures, jain=figures, served=figures)
def test_any_summary_gives_finite_figures_or_none(quiet: Any, flood: Any, jain: Any,
                                                   served: Any) -> None:
    data = summary(quiet, flood)
    data["fairness"]["jain_index"] = jain
    data["stability"]["served_tokens_per_s"] = served
    head = headline(data)
    for value in (head.victim_quiet_ttft_p99_s, head.victim_flood_ttft_p99_s,
                  head.jain_index, head.served_tokens_per_s, head.victim_ratio):
        assert value is None or (isinstance(value, float) and math.isfinite(value))
    if head.victim_ratio is not None:
        assert head.victim_ratio == head.victim_flood_ttft_p99_s / head.victim_quiet_ttft_p99_s
    assert len(headline_rows(head, head)) == 7
