"""--check expressions: parsed without eval, resolved into summary.json."""

from __future__ import annotations

import pytest

from weighbridge.analysis.gate import Check, evaluate, parse_check, resolve

SUMMARY = {"fairness": {"jain_index": 0.97, "max_min_share_ratio": None},
           "tiers": {"interactive": {"ttft_p99_s": 0.42}},
           "tenants": {"team.alpha": {"ok": 10}, "team": {"ok": 3}}}


@pytest.mark.parametrize("text, expected", [
    ("fairness.jain_index>=0.95", Check("fairness.jain_index", ">=", 0.95)),
    (" tiers.interactive.ttft_p99_s <= 0.5 ", Check("tiers.interactive.ttft_p99_s", "<=", 0.5)),
    ("a.b==1e3", Check("a.b", "==", 1000.0)),
    ("a<-2", Check("a", "<", -2.0)),
    ("a>.5", Check("a", ">", 0.5)),
])
def test_parse(text: str, expected: Check) -> None:
    assert parse_check(text) == expected


@pytest.mark.parametrize("text", ["fairness.jain_index", "x >= y", "x => 1", ">= 1",
                                  "__import__('os').system('true') > 1", "a >= 1 2"])
def test_bad_expressions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bad check"):
        parse_check(text)


def test_names_with_dots_resolve() -> None:
    assert resolve(SUMMARY, "tenants.team.alpha.ok") == 10
    assert resolve(SUMMARY, "tenants.team.ok") == 3


@pytest.mark.parametrize("text, passed", [
    ("fairness.jain_index>=0.95", True), ("fairness.jain_index>0.97", False),
    ("fairness.jain_index==0.97", True), ("tiers.interactive.ttft_p99_s<0.5", True),
    ("tiers.interactive.ttft_p99_s<=0.4", False),
])
def test_operators(text: str, passed: bool) -> None:
    verdict = evaluate(parse_check(text), SUMMARY)
    assert verdict.passed is passed
    assert verdict.message.startswith("ok" if passed else "FAIL")


def test_missing_and_null_values_fail_with_a_reason() -> None:
    missing = evaluate(parse_check("tiers.batch.ttft_p99_s<1"), SUMMARY)
    assert not missing.passed and "tiers has no 'batch' (it has: interactive)" in missing.message
    null = evaluate(parse_check("fairness.max_min_share_ratio<=2"), SUMMARY)
    assert not null.passed and "null" in null.message
    section = evaluate(parse_check("tiers.interactive<=2"), SUMMARY)
    assert not section.passed and "dict" in section.message
