"""deploy/prometheus/rules/loadgen.yml evaluated by Prometheus' own rule engine (``promtool
test rules``): hand-computed series, and the raw series of an exporter driven through a
steady run, whose rule-derived Little's Law ratio must agree with the exporter's."""

from __future__ import annotations

import math
import random
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest

from tests.support.metrics import parse
from tests.unit.exporters.test_loadgen_exporter import (
    RUN_START,
    FakeClock,
    Sent,
    steady_two_tenants,
)
from weighbridge.exporters.loadgen import LoadgenExporter

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "deploy" / "prometheus" / "rules" / "loadgen.yml"


def promtool_test(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    """Run ``promtool test rules``; a missing promtool fails the test (it is a CI package)."""
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "10s",
                                    "tests": tests}, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_are_valid() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{label_text}}}", "values": values}


def sample(name: str, value: float, **labels: str) -> dict[str, Any]:
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"labels": f"{name}{{{label_text}}}" if name else f"{{{label_text}}}",
            "value": value}


def expect(expr: str, *samples: dict[str, Any], at: str = "2m") -> dict[str, Any]:
    return {"expr": expr, "eval_time": at, "exp_samples": list(samples)}


def test_hand_computed_series(tmp_path: Path) -> None:
    """Linear counters over 10 s steps (rates are exact): a, b and c, where c only has a
    request in flight."""
    a = {"tenant": "a", "tier": "standard", "instance": "w1"}
    b = {"tenant": "b", "tier": "batch", "instance": "w1"}
    c = {"tenant": "c", "tier": "batch", "instance": "w1"}
    c_zero = "0x30"
    inputs = [
        # Little's Law raw series: per 10 s step.
        series("weighbridge_client_in_flight_request_seconds_total", "0+20x30", **a),
        series("weighbridge_client_time_in_system_seconds_total", "0+20x30", **a),
        series("weighbridge_client_in_flight_token_seconds_total", "0+5000x30", **a),
        series("weighbridge_client_time_in_system_token_seconds_total", "0+4000x30", **a),
        series("weighbridge_client_in_flight_request_seconds_total", "0+10x30", **b),
        series("weighbridge_client_time_in_system_seconds_total", "0+5x30", **b),
        series("weighbridge_client_in_flight_token_seconds_total", "0+100x30", **b),
        series("weighbridge_client_time_in_system_token_seconds_total", "0+100x30", **b),
        # Tokens: a 60/s, b 20/s, c nothing.
        series("weighbridge_client_prompt_tokens_total", "0+300x30", **a),
        series("weighbridge_client_output_tokens_total", "0+300x30", **a),
        series("weighbridge_client_prompt_tokens_total", "0+100x30", **b),
        series("weighbridge_client_output_tokens_total", "0+100x30", **b),
        series("weighbridge_client_prompt_tokens_total", c_zero, **c),
        series("weighbridge_client_output_tokens_total", c_zero, **c),
        # Requests: a 1/s, b 0.5/s, all ok; c none ended but one in flight.
        series("weighbridge_client_requests_total", "0+10x30", status="ok", **a),
        series("weighbridge_client_requests_total", "0+5x30", status="ok", **b),
        series("weighbridge_client_requests_total", c_zero, status="ok", **c),
        series("weighbridge_client_requests_scheduled_total", "0+10x30", **a),
        series("weighbridge_client_requests_scheduled_total", "0+5x30", **b),
        series("weighbridge_client_requests_scheduled_total", c_zero, **c),
        series("weighbridge_client_in_flight_requests", "2x30", **a),
        series("weighbridge_client_in_flight_requests", "0x30", **b),
        series("weighbridge_client_in_flight_requests", "1x30", **c),
        series("weighbridge_tenant_weight", "3x30", tenant="a", instance="w1"),
        series("weighbridge_tenant_weight", "1x30", tenant="b", instance="w1"),
        series("weighbridge_tenant_weight", "1x30", tenant="c", instance="w1"),
    ]
    ratio = "tenant_level:weighbridge_littles_law_ratio:rate1m"
    share = "tenant:weighbridge_tenant_token_share:rate1m"
    entitled = "tenant:weighbridge_tenant_entitled_share:1m"
    client_only = {
        "interval": "10s",
        "input_series": inputs,
        "promql_expr_test": [
            expect("tenant_level:weighbridge_littles_law_l:rate1m",
                   sample("tenant_level:weighbridge_littles_law_l:rate1m", 2, tenant="a",
                          level="request"),
                   sample("tenant_level:weighbridge_littles_law_l:rate1m", 500, tenant="a",
                          level="token"),
                   sample("tenant_level:weighbridge_littles_law_l:rate1m", 1, tenant="b",
                          level="request"),
                   sample("tenant_level:weighbridge_littles_law_l:rate1m", 10, tenant="b",
                          level="token")),
            expect(ratio,
                   sample(ratio, 1, tenant="a", level="request"),
                   sample(ratio, 1.25, tenant="a", level="token"),
                   sample(ratio, 2, tenant="b", level="request"),
                   sample(ratio, 1, tenant="b", level="token")),
            expect(share, sample(share, 0.75, tenant="a"), sample(share, 0.25, tenant="b"),
                   sample(share, 0, tenant="c")),
            expect(entitled, sample(entitled, 0.6, tenant="a"), sample(entitled, 0.2, tenant="b"),
                   sample(entitled, 0.2, tenant="c")),
            # x = (20, 20, 0): (40)^2 / (3 * 800)
            expect("weighbridge_jain_index:rate1m",
                   sample("weighbridge_jain_index:rate1m", 2 / 3)),
            expect("weighbridge_offered_tokens_per_second:rate1m",
                   sample("weighbridge_offered_tokens_per_second:rate1m", 80)),
            expect("weighbridge_served_tokens_per_second:rate1m",
                   sample("weighbridge_served_tokens_per_second:rate1m", 80)),
            expect("weighbridge_offered_token_load_ratio:rate1m",
                   sample("weighbridge_offered_token_load_ratio:rate1m", 1)),
        ],
    }
    with_backend = {
        "interval": "10s",
        "input_series": [
            *inputs,
            series("vllm:prompt_tokens_total", "0+600x30", model_name="m", instance="e1"),
            series("vllm:generation_tokens_total", "0+400x30", model_name="m", instance="e1"),
        ],
        "promql_expr_test": [
            expect("weighbridge_served_tokens_per_second:rate1m",
                   sample("weighbridge_served_tokens_per_second:rate1m", 100)),
            expect("weighbridge_offered_token_load_ratio:rate1m",
                   sample("weighbridge_offered_token_load_ratio:rate1m", 0.8)),
        ],
    }
    promtool_test(tmp_path, [client_only, with_backend])


RAW = ("weighbridge_client_in_flight_request_seconds_total",
       "weighbridge_client_in_flight_token_seconds_total",
       "weighbridge_client_time_in_system_seconds_total",
       "weighbridge_client_time_in_system_token_seconds_total")


def scrape_samples(exporter: LoadgenExporter) -> dict[str, float]:
    """{series text: value} of the raw Little's Law counters and the exporter's ratio."""
    out: dict[str, float] = {}
    scrape = parse(generate_latest(exporter.registry).decode())
    for name in (*RAW, "weighbridge_littles_law_ratio"):
        for got, value in scrape.samples.get(name, ()):
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(got.items()))
            out[f"{name}{{{labels}}}"] = value
    return out


def run_and_scrape(requests: list[Sent], horizon: float, step: float,
                   window_s: float) -> dict[str, list[float]]:
    clock = FakeClock()
    exporter = LoadgenExporter(tiers={"a": "standard", "b": "standard"}, window_s=window_s,
                               clock=clock)
    events = sorted([(s.record.scheduled_s, 0, i) for i, s in enumerate(requests)]
                    + [(s.record.end_s, 1, i) for i, s in enumerate(requests)
                       if s.end_reported])
    scrapes: dict[str, list[float]] = {}
    k = 0
    for n in range(int(horizon / step) + 1):
        t = n * step
        while k < len(events) and events[k][0] <= t:
            at, kind, i = events[k]
            clock.now = RUN_START + at
            rec = requests[i].record
            if kind == 0:
                exporter.request_started(rec.tenant, rec.tier, requests[i].declared or 0,
                                         clock.now)
            else:
                exporter.request_ended(rec, clock.now)
            k += 1
        clock.now = RUN_START + t
        for name, value in scrape_samples(exporter).items():
            scrapes.setdefault(name, [math.nan] * n).append(value)
    return scrapes


def test_rules_agree_with_the_exporter_on_a_steady_run(tmp_path: Path) -> None:
    """Acceptance 2's comparison in miniature: the same steady run, the exporter's ratio and
    the recording rule's, both within [0.9, 1.1] and within 0.05 of each other."""
    step, horizon = 5.0, 180.0
    scrapes = run_and_scrape(steady_two_tenants(random.Random(21), horizon), horizon, step,
                             window_s=60.0)
    inputs = [{"series": name,
               "values": " ".join("_" if not math.isfinite(v) else repr(v) for v in values)}
              for name, values in scrapes.items()]
    ok = [sample("", 1, tenant=t, level=lvl) for t in ("a", "b") for lvl in ("request", "token")]
    rule = "tenant_level:weighbridge_littles_law_ratio:rate1m"
    promtool_test(tmp_path, [{
        "interval": f"{int(step)}s",
        "input_series": inputs,
        "promql_expr_test": [
            expect(f"({rule} > bool 0.9) * ({rule} < bool 1.1)", *ok, at="3m"),
            expect("(weighbridge_littles_law_ratio > bool 0.9)"
                   " * (weighbridge_littles_law_ratio < bool 1.1)", *ok, at="3m"),
            expect(f"abs({rule} - on (tenant, level) weighbridge_littles_law_ratio) < bool 0.05",
                   *ok, at="3m"),
        ],
    }])


def test_rules_depart_from_one_when_requests_are_lost(tmp_path: Path) -> None:
    step, horizon = 5.0, 180.0
    scrapes = run_and_scrape(steady_two_tenants(random.Random(21), horizon, drop_every=5),
                             horizon, step, window_s=60.0)
    inputs = [{"series": name,
               "values": " ".join("_" if not math.isfinite(v) else repr(v) for v in values)}
              for name, values in scrapes.items()]
    rule = "tenant_level:weighbridge_littles_law_ratio:rate1m"
    ok = [sample("", 1, tenant=t, level=lvl) for t in ("a", "b") for lvl in ("request", "token")]
    promtool_test(tmp_path, [{
        "interval": f"{int(step)}s",
        "input_series": inputs,
        "promql_expr_test": [expect(f"{rule} > bool 1.5", *ok, at="3m")],
    }])
