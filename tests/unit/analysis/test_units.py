"""Every unit the report prints, and the comparison table's units and order (issue 18: a
rate whose key ends in ``_s`` was printed x1000 as milliseconds)."""

from __future__ import annotations

import pytest

from weighbridge.analysis.compare import (
    FAIRNESS_KEYS,
    ISOLATION_KEYS,
    STABILITY_KEYS,
    TENANT_KEYS,
    TIER_KEYS,
    Difference,
)
from weighbridge.analysis.tables import comparison_table
from weighbridge.analysis.units import (
    INDEX,
    MILLISECONDS,
    PERCENT,
    RATIO,
    REQUESTS,
    REQUESTS_PER_S,
    TOKENS,
    TOKENS_PER_S,
    UNITS,
    WEIGHTED_TOKENS,
    unit_of,
)


def test_milliseconds_are_stored_as_seconds() -> None:
    assert unit_of("tenants.a.ttft_p99_s") is MILLISECONDS
    assert MILLISECONDS.format(0.1234) == "123"  # 0.1234 s = 123.4 ms, three digits
    assert MILLISECONDS.format(7.7) == "7,700"
    assert MILLISECONDS.with_label(0.0421) == "42.1 ms"
    assert MILLISECONDS.format_difference(-0.5) == "\u2212500 ms"


def test_a_rate_ending_in_s_is_not_a_duration() -> None:
    # The bug: goodput_tokens_per_s ends in "_s" and was shown as 1,044,314 "ms".
    assert unit_of("tiers.interactive.goodput_tokens_per_s") is TOKENS_PER_S
    assert TOKENS_PER_S.format(1044.314) == "1,044"
    assert TOKENS_PER_S.with_label(12.5) == "12.5 tok/s"
    assert unit_of("stability.served_tokens_per_s") is TOKENS_PER_S
    assert unit_of("tenants.a.decode_tps_p50") is TOKENS_PER_S


def test_percent_is_stored_as_a_fraction_and_differs_in_points() -> None:
    assert unit_of("tiers.interactive.slo_attainment") is PERCENT
    assert PERCENT.with_label(0.678) == "67.8%"
    assert PERCENT.format_difference(0.678 - 0.378) == "+30.0 pp"


def test_counts_of_tokens_and_requests() -> None:
    assert unit_of("tenants.a.prompt_tokens") is TOKENS
    assert TOKENS.with_label(1234567) == "1,234,567 tokens"
    assert unit_of("tenants.a.requests") is REQUESTS and unit_of("tenants.a.failed") is REQUESTS
    assert REQUESTS.format(12.0) == "12"
    assert REQUESTS.format_difference(-3) == "\u22123 requests"


def test_dimensionless_index_and_ratio() -> None:
    assert unit_of("fairness.jain_index") is INDEX and unit_of("isolation.leakage") is INDEX
    assert INDEX.with_label(0.84455) == "0.845"
    assert unit_of("fairness.max_min_share_ratio") is RATIO
    assert unit_of("isolation.flood_over_quiet") is RATIO
    assert RATIO.with_label(1.5) == "1.50\u00d7"
    assert RATIO.with_label(114.6) == "115\u00d7"


def test_weighted_tokens_and_request_rate() -> None:
    assert unit_of("fairness.max_service_difference") is WEIGHTED_TOKENS
    assert WEIGHTED_TOKENS.with_label(250) == "250 tokens/weight"
    assert unit_of("littles_law.a.arrival_rate") is REQUESTS_PER_S
    assert REQUESTS_PER_S.with_label(0.3) == "0.3 req/s"


def test_every_compared_key_declares_its_unit_and_undeclared_keys_fail() -> None:
    for key in (*TENANT_KEYS, *TIER_KEYS, *FAIRNESS_KEYS, *ISOLATION_KEYS, *STABILITY_KEYS):
        assert key in UNITS, key
    assert unit_of("tenants.acme.eu.ttft_p99_s") is MILLISECONDS  # a name with a dot
    with pytest.raises(KeyError, match="no unit declared"):
        unit_of("tiers.interactive.goodput_per_s")  # never guessed from the suffix


def test_comparison_shows_units_and_sorts_by_relative_change() -> None:
    rows = [Difference("tenants.b.ttft_p99_s", 0.9, 1.0),  # -10%
            Difference("tiers.i.goodput_tokens_per_s", 1044.314, 522.157),  # +100%
            Difference("tiers.i.slo_attainment", 0.25, 1.0),  # -75%
            Difference("fairness.jain_index", None, 0.5),  # undefined here
            Difference("tenants.b.rejected", 3.0, 0.0),  # baseline 0
            Difference("fairness.max_min_share_ratio", None, None)]  # left out
    table = comparison_table(rows, "wb", "fifo")
    assert table.collapsed and table.columns[0] == "metric (unit)"
    assert [r[0] for r in table.rows] == [
        "tiers.i.goodput_tokens_per_s (tok/s)", "tiers.i.slo_attainment (%)",
        "tenants.b.ttft_p99_s (ms)", "fairness.jain_index", "tenants.b.rejected (requests)"]
    assert table.rows[0][1:] == ("1,044", "522", "+522 tok/s", "+100.0%")
    assert table.rows[1][1:] == ("25.0", "100.0", "\u221275.0 pp", "\u221275.0%")
    assert table.rows[2][1:] == ("900", "1,000", "\u2212100 ms", "\u221210.0%")
    assert table.rows[3][1:] == ("— (undefined in this run)", "0.5",
                                 "— (undefined in this run)", "— (undefined in this run)")
    assert table.rows[4][1:] == ("3", "0", "+3 requests", "— (the baseline is 0)")
