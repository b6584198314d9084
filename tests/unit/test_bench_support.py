"""The benchmark runner's pure parts: RESULTS.md sections and /metrics histogram deltas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import _prom, _results
from benchmarks._core import Benchmark, BenchResult, Table, load, module_names
from weighbridge.records import RequestRecord

METRICS_BEFORE = """\
# TYPE lag_seconds histogram
lag_seconds_bucket{model_name="m",le="0.001"} 10.0
lag_seconds_bucket{model_name="m",le="0.01"} 10.0
lag_seconds_bucket{model_name="m",le="+Inf"} 10.0
lag_seconds_count{model_name="m"} 10.0
lag_seconds_sum{model_name="m"} 0.005
"""
METRICS_AFTER = """\
# TYPE lag_seconds histogram
lag_seconds_bucket{model_name="m",le="0.001"} 60.0
lag_seconds_bucket{model_name="m",le="0.01"} 109.0
lag_seconds_bucket{model_name="m",le="+Inf"} 110.0
lag_seconds_count{model_name="m"} 110.0
lag_seconds_sum{model_name="m"} 0.305
"""


def test_histogram_delta_mean_and_quantiles() -> None:
    h = _prom.histogram_delta(_prom.parse(METRICS_BEFORE), _prom.parse(METRICS_AFTER),
                              "lag_seconds")
    assert h.count == 100
    assert h.mean == pytest.approx(0.003)
    assert h.quantile(0.5) == pytest.approx(0.001)  # rank 50 ends the first bucket
    # rank 75 is 25 of the 49 observations into (0.001, 0.01]
    assert h.quantile(0.75) == pytest.approx(0.001 + 0.009 * 25 / 49)
    assert h.upper_bound(0.99) == 0.01
    assert math.isinf(h.upper_bound(1.0))


def test_write_section_replaces_only_its_own(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    bench_a = Benchmark(name="a", title="A", run=lambda ctx: BenchResult([], []))
    bench_b = Benchmark(name="b", title="B", run=lambda ctx: BenchResult([], []))

    def section(bench: Benchmark, value: str) -> str:
        result = BenchResult(summary=[f"value {value}"],
                             tables=[Table(("k", "v"), [("x", value)])], passed=True)
        return _results.render(bench, result, date="d", command="c", machine="m")

    _results.write_section("a", section(bench_a, "1"), path)
    _results.write_section("b", section(bench_b, "2"), path)
    path.write_text(path.read_text() + "\nhand-written note\n")
    _results.write_section("a", section(bench_a, "3"), path)
    text = path.read_text()
    assert text.startswith("# Benchmark results")
    assert "| x | 3 |" in text and "| x | 1 |" not in text
    assert "| x | 2 |" in text and "hand-written note" in text
    assert text.index("## a:") < text.index("## b:")


def test_registered_benchmarks_load() -> None:
    names = module_names()
    assert {"emulator_speed", "http_stack"} <= set(names)
    for name in ("emulator_speed", "http_stack"):
        bench = load(name)
        assert bench is not None and bench.name == name and not bench.needs_vllm


def _record(rid: str, sent: float, first: float, end: float) -> RequestRecord:
    return RequestRecord(run_id="r", scenario="s", phase="p", request_id=rid, tenant="t",
                         tier="x", endpoint="/v1/chat/completions", stream=True,
                         scheduled_s=sent, sent_s=sent, first_token_s=first,
                         last_token_s=end, end_s=end, status="ok")


def test_fidelity_sessions_groups_ttft_by_what_was_in_flight() -> None:
    from benchmarks.fidelity_sessions import by_crowd

    records = [
        _record("alone", 0.0, 0.010, 0.100),    # nothing in flight
        _record("beside", 0.050, 0.070, 0.300),  # "alone" is decoding
        _record("early", 0.055, 0.080, 0.200),   # "beside" has no first token yet
        _record("two", 0.150, 0.160, 0.400),     # "beside" and "early" decode
    ]
    crowd = by_crowd(records)
    assert {c: n for c, (n, _, _) in crowd.items()} == {
        "nothing": 1, "1 decoding": 1, "1+ before its first token": 1, "2+ decoding": 1}
    assert crowd["1 decoding"][1] == pytest.approx(0.020)
