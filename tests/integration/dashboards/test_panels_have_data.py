"""Acceptance 2: a short real run (emulator, sidecar, the Locust load generator with its
exporter) scraped by a real Prometheus with the project's rules: every query of every
dashboard panel returns data, with the template variables set to All (``.*``) and to real
values. The dashboards, the exporters and the recording rules agree on every metric name
and label.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import locust
from tests.support.prometheus import (
    PrometheusApi,
    ScrapeTarget,
    prometheus_process,
    rule_files,
)
from weighbridge.dashboards.generate import DASHBOARDS
from weighbridge.dashboards.model import Query
from weighbridge.dashboards.variables import E2E_SLO, TTFT_SLO, interpolate
from weighbridge.launch import emulator_process, free_port, sidecar_process

REPO = Path(__file__).resolve().parents[3]
BACKEND = "emu-0"
SETTLE_S = 15.0  # load before the first query: several rule evaluations over real traffic
QUERY_TIMEOUT_S = 20.0

# The interactive tenant runs agent programs into its rate limit (a rejection reason, and
# programs completed and failed, on the panels); the batch tenant's closed loop keeps the
# engine saturated, so the sidecar queues and admission holds from the start.
TENANTS_FILE = """
tenants:
  - name: chat
    api_key: sk-chat-dash
    tier: interactive
    weight: 2
    endpoint: chat
    users: 20
    lengths:
      prompt: {kind: uniform, low: 32, high: 128}
      output: {kind: uniform, low: 16, high: 40}
    programs: {calls: {kind: uniform, low: 1, high: 2}, tool_ms: 200, tool_output: 16}
    identity: [claude_code]
    arrival: {kind: poisson, rate: 1}
  - name: api-a
    api_key: sk-api-a-dash
    tier: standard
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 64, high: 256}
      output: {kind: uniform, low: 24, high: 64}
    arrival: {kind: poisson, rate: 3}
  - name: api-b
    api_key: sk-api-b-dash
    tier: standard
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 64, high: 256}
      output: {kind: uniform, low: 24, high: 64}
    arrival: {kind: poisson, rate: 3}
  - name: batch
    api_key: sk-batch-dash
    tier: batch
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 128, high: 384}
      output: {kind: uniform, low: 32, high: 96}
    phases:
      steady: {kind: closed, users: 6, think_s: 0}
"""
SIDECAR_TENANTS = {
    "chat": {"tier": "interactive", "weight": 2.0, "api_keys": ["plain:sk-chat-dash"],
             "limits": {"requests_per_minute": 24}},
    "api-a": {"tier": "standard", "weight": 1.0, "api_keys": ["plain:sk-api-a-dash"]},
    "api-b": {"tier": "standard", "weight": 1.0, "api_keys": ["plain:sk-api-b-dash"]},
    "batch": {"tier": "batch", "weight": 1.0, "api_keys": ["plain:sk-batch-dash"]},
}
# The values a user would pick: the rate-limited interactive tenant exercises every panel.
CONCRETE = {"tenant": "chat", "tier": "interactive", "backend": BACKEND}


@dataclass
class Stack:
    prometheus: PrometheusApi


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboards")
    with contextlib.ExitStack() as processes:
        emulator = processes.enter_context(emulator_process(
            max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=64, max_model_len=1024))
        sidecar = processes.enter_context(sidecar_process({
            "backends": [{"url": emulator.url, "name": BACKEND}],
            "tenants": SIDECAR_TENANTS,
            "admission": {"max_inflight_per_backend": 6, "metrics_poll_ms": 100,
                          "metrics_stale_ms": 1000},
        }, config_dir=tmp))
        exporter_port = free_port()
        targets = [ScrapeTarget("vllm", emulator.url),
                   ScrapeTarget("weighbridge-sidecar", sidecar.url),
                   ScrapeTarget("weighbridge-loadgen", f"http://127.0.0.1:{exporter_port}")]
        (tmp / "prometheus").mkdir()
        server = processes.enter_context(prometheus_process(
            targets, rule_files(), interval_s=1.0, directory=tmp / "prometheus"))
        api = PrometheusApi(server.url)
        processes.callback(api.close)
        tenants = tmp / "tenants.yaml"
        tenants.write_text(TENANTS_FILE)
        # The exporter's /metrics answering means the run has started. Queries run while
        # the load goes on: a stopped exporter's series go stale at once.
        processes.enter_context(locust.process(
            sidecar.url, tmp / "run", "240s", exporter_port, tmp / "locust.log",
            "--tenants-file", str(tenants),
            "--stretch", "4"))  # the steady phase outlasts the queries
        api.wait_until_up([t.job for t in targets])
        time.sleep(SETTLE_S)
        yield Stack(api)


def _values(concrete: Mapping[str, str]) -> dict[str, str]:
    return {"tenant": ".*", "tier": ".*", "backend": ".*", **concrete,
            "ttft_slo": TTFT_SLO.default, "e2e_slo": E2E_SLO.default,
            # Grafana's own: at least 4 scrape intervals; the dashboard's whole range.
            "__rate_interval": "20s", "__range": "5m"}


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _first_data(api: PrometheusApi, expr: str) -> list[dict] | None:
    """The first result with a finite value within QUERY_TIMEOUT_S, else None."""
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while True:
        result = api.query(expr)
        if _finite(result):
            return result
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def _engine_only(query: Query) -> bool:
    """vLLM's own series: the test's scrape configuration gives the engine no ``backend``
    label (deploy/compose/prometheus.yml does), so a concrete backend selects none."""
    return "vllm:" in query.expr


def _empty_queries(api: PrometheusApi, concrete: Mapping[str, str]) -> list[str]:
    values = _values(concrete)
    empty = []
    for dashboard in DASHBOARDS:
        for panel, query in dashboard.queries():
            if concrete and _engine_only(query):
                continue
            expr = interpolate(query.expr, values)
            if _first_data(api, expr) is None:
                empty.append(f"{dashboard.title} / {panel.title} / {query.legend}: {expr}")
    return empty


def test_every_panel_query_returns_data_for_all(stack: Stack) -> None:
    empty = _empty_queries(stack.prometheus, {})
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_panel_query_returns_data_for_one_tenant_tier_and_backend(stack: Stack) -> None:
    empty = _empty_queries(stack.prometheus, CONCRETE)
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_variable_queries_list_the_real_values(stack: Stack) -> None:
    """The tenant, tier and backend variables' label_values() find the run's values."""
    api = stack.prometheus
    for dashboard in DASHBOARDS[:1]:
        for variable in dashboard.variables:
            selector = getattr(variable, "selector", None)
            if selector is None:
                continue
            found = {s.get(variable.name) for s in api.series(selector)}
            wanted = {"tenant": set(SIDECAR_TENANTS), "tier": {"interactive", "standard"},
                      "backend": {BACKEND}}[variable.name]
            assert wanted <= found, (variable.name, found)

