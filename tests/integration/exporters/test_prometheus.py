"""A real Prometheus scrapes the emulator and the sidecar during a short two-tenant run, with
the project's rules files loaded: every metric docs/metrics.md documents for the sidecar and
the emulator must exist there with its labels, and every sidecar recording rule must
evaluate to a non-empty, sensible result.

The targets are a list, so the load generator's exporter joins as one more ScrapeTarget.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support import driver, loopback
from tests.support.metrics import parse
from tests.support.prometheus import (
    REPO,
    RULES_DIR,
    PrometheusApi,
    ScrapeTarget,
    check_config,
    check_rules,
    prometheus_process,
    rule_files,
)
from weighbridge.launch import emulator_process, sidecar_process

DOCS = REPO / "docs" / "metrics.md"
SIDECAR_RULES = RULES_DIR / "sidecar.yml"
MODEL = "weighbridge-emulator"
KEYS = {"heavy": "sk-heavy-prom", "light": "sk-light-prom"}
WEIGHTS = {"heavy": 2.0, "light": 1.0}
LOAD_S = 8.0


# ----------------------------------------------------------------------------- the docs


@dataclass(frozen=True)
class Documented:
    name: str
    type: str
    labels: frozenset[str]

    def series_name(self) -> str:
        """A series name that exists for every type (histograms have no bare series)."""
        return self.name + "_count" if self.type == "histogram" else self.name


def documented_metrics(section: str, text: str | None = None) -> list[Documented]:
    """The rows of the metric tables under ``## {section}`` in docs/metrics.md."""
    text = DOCS.read_text() if text is None else text
    match = re.search(rf"^## {re.escape(section)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/metrics.md has no section {section!r}"
    rows = []
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`") or cells[1] not in (
                "counter", "gauge", "histogram"):
            continue
        labels = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        rows.append(Documented(cells[0].strip("`"), cells[1], labels))
    assert rows, f"no metric rows under {section!r}"
    return rows


def test_the_docs_follow_prometheus_naming() -> None:
    for section in ("Sidecar", "Emulator", "Load generator"):
        for metric in documented_metrics(section):
            if metric.name.startswith("vllm:"):
                continue  # vLLM's names, kept as vLLM exports them
            assert metric.name.startswith("weighbridge_"), metric
            assert (metric.type == "counter") == metric.name.endswith("_total"), metric
            assert not re.search(r"_(ms|milliseconds|minutes|percent|perc)(_|$)", metric.name)


def test_rules_and_the_example_configuration_are_valid() -> None:
    files = rule_files()
    assert SIDECAR_RULES in files
    output = check_rules(files)
    assert "SUCCESS" in output
    check_config(REPO / "deploy" / "prometheus" / "prometheus.yml")


# ----------------------------------------------------------------------------- the run


@dataclass
class Stack:
    prometheus: PrometheusApi
    emulator: str
    sidecar: str
    outcomes: list[driver.Outcome]
    end_unix_s: float  # wall-clock end of the load (Prometheus' time axis)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with contextlib.ExitStack() as processes:
        emulator = processes.enter_context(emulator_process(
            max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=256,
            max_model_len=2048))
        config = {
            "backends": [{"url": emulator.url, "name": "emu-0"}],
            "tenants": {name: {"tier": "standard", "weight": WEIGHTS[name],
                               "api_keys": [f"plain:{key}"]} for name, key in KEYS.items()},
            # A small cap, so requests wait in the sidecar and admission holds happen.
            "admission": {"max_inflight_per_backend": 4, "metrics_poll_ms": 100,
                          "metrics_stale_ms": 1000},
        }
        sidecar = processes.enter_context(sidecar_process(config))
        targets = [ScrapeTarget("emulator", emulator.url),
                   ScrapeTarget("weighbridge-sidecar", sidecar.url)]
        server = processes.enter_context(prometheus_process(
            targets, rule_files(), interval_s=1.0,
            directory=tmp_path_factory.mktemp("prometheus")))
        api = PrometheusApi(server.url)
        processes.callback(api.close)
        api.wait_until_up([t.job for t in targets])
        outcomes = asyncio.run(_drive(sidecar.url))
        end = time.time()
        # Prometheus scrapes the end of the run and evaluates the rules on it.
        api.wait_past(end)
        yield Stack(api, emulator.url, sidecar.url, outcomes, end)


async def _drive(sidecar_url: str) -> list[driver.Outcome]:
    """Two backlogged tenants (closed loops) for LOAD_S, plus one unauthorized and one
    invalid request, so that rejections by reason exist too."""
    url = sidecar_url + "/v1/completions"
    # Continuous usage: a stream cut off at the end of the run still knows its counts.
    body = driver.completion_body(64, 24, MODEL, continuous_usage=True)
    async with driver.session() as session:
        t0 = time.monotonic()

        def loop(tenant: str) -> asyncio.Future[list[driver.Outcome]]:
            async def send(_client: int, scheduled_s: float, out: driver.Outcome) -> None:
                await driver.streamed_request(session, url, KEYS[tenant], tenant, body,
                                              scheduled_s, t0, out=out)
            return asyncio.ensure_future(driver.closed_loop(6, t0, LOAD_S, send, tenant))

        runs = [loop(tenant) for tenant in KEYS]
        async with session.post(url, data=body, headers={"authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with session.post(url, json={"prompt": [1], "max_tokens": 0},
                                headers={"authorization": f"Bearer {KEYS['light']}"}) as r:
            assert r.status == 400
        outcomes = [o for run in await asyncio.gather(*runs) for o in run]
    served = [o for o in outcomes if o.ok]
    assert len(served) >= 20, f"only {len(served)} requests served"
    assert {o.tenant for o in served} == set(KEYS)
    return outcomes


def test_every_documented_metric_exists_with_its_labels(stack: Stack) -> None:
    missing, unlabelled = [], []
    for section in ("Sidecar", "Emulator"):
        for metric in documented_metrics(section):
            series = stack.prometheus.series(f'{{__name__="{metric.series_name()}"}}')
            if not series:
                missing.append(metric.name)
                continue
            seen = set().union(*(s.keys() for s in series))
            if not metric.labels <= seen:
                unlabelled.append((metric.name, sorted(metric.labels - seen)))
    assert not missing, f"documented but not in Prometheus: {missing}"
    assert not unlabelled, f"documented labels missing: {unlabelled}"


def test_every_exported_sidecar_metric_is_documented(stack: Stack) -> None:
    """The reverse check: nothing the sidecar exports is left out of docs/metrics.md."""
    documented = {m.name for m in documented_metrics("Sidecar")}
    response = loopback.get(stack.sidecar + "/metrics", timeout=5)
    exported = {name + "_total" if kind == "counter" else name
                for name, kind in parse(response.text).types.items()}
    assert exported, response.text
    assert exported - documented == set()


def test_sidecar_recording_rules_evaluate(stack: Stack) -> None:
    api = stack.prometheus
    rules = [rule["record"] for group in yaml.safe_load(SIDECAR_RULES.read_text())["groups"]
             for rule in group["rules"] if "record" in rule]
    assert len(rules) >= 10
    results = {name: api.wait_for(name, timeout_s=20) for name in rules}

    health = {rule["name"]: (rule["health"], rule.get("lastError"))
              for group in api.rule_groups() if group["file"] == str(SIDECAR_RULES)
              for rule in group["rules"]}
    bad = {name: h for name, h in health.items() if h[0] != "ok"}
    assert not bad, bad

    def values(name: str) -> dict[str, float]:
        return {r["metric"].get("tenant", r["metric"].get("tier", "")): float(r["value"][1])
                for r in results[name]}

    shares = values("tenant:weighbridge_token_share:ratio_rate1m")
    assert set(shares) == set(KEYS)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    jain = values("tier:weighbridge_jain_index:rate1m")["standard"]
    assert 0.5 <= jain <= 1.0 + 1e-9  # two tenants: 1/n = 0.5 is the floor
    assert values("job:weighbridge_requests_unaccounted:sum")[""] == 0
    assert values("job:weighbridge_stability_ratio:rate1m")[""] > 0
    assert values("job:weighbridge_sidecar_littles_law_ratio:rate1m")[""] > 0


def test_the_sidecars_own_stability_reading_matches_the_rule_scale(stack: Stack) -> None:
    """The sidecar exports both sides and the ratio; while its backend is busy both are
    positive and the ratio is their quotient."""
    api = stack.prometheus
    offered = api.wait_for("max_over_time(weighbridge_stability_offered_tokens_per_second[1m])")
    capacity = api.wait_for(
        'max_over_time(weighbridge_stability_capacity_tokens_per_second{source="backends"}[1m])')
    ratio = api.wait_for("max_over_time(weighbridge_stability_ratio[1m])")
    assert float(offered[0]["value"][1]) > 0
    assert float(capacity[0]["value"][1]) > 0
    assert float(ratio[0]["value"][1]) > 0


def test_documented_rows_parse(tmp_path: Path) -> None:
    """The docs parser reads what the tables say (guards the checks above)."""
    text = ("## Sidecar\n| metric | type | labels | unit | meaning | PromQL |\n|---|---|---|---|"
            "---|---|\n| `a_total` | counter | `tenant`, `tier` | x | y | z |\n"
            "| `b` | gauge | — | x | y | z |\n"
            "## Emulator\n| `c` | histogram | `engine` | x | y | z |\n")
    rows = documented_metrics("Sidecar", text)
    assert rows == [Documented("a_total", "counter", frozenset({"tenant", "tier"})),
                    Documented("b", "gauge", frozenset())]
    assert documented_metrics("Emulator", text)[0].series_name() == "c_count"


def test_token_share_rule_matches_the_runs_records(stack: Stack) -> None:
    """Per-tenant share of the tokens served, from the streamed-tokens counter through the
    recording rule, against the client's own counts of the same run: within 2%."""
    records = {tenant: 0.0 for tenant in KEYS}
    for o in stack.outcomes:
        if o.first_token_s is not None:
            records[o.tenant] += o.prompt_tokens + o.output_tokens
    total = sum(records.values())
    expected = {tenant: tokens / total for tenant, tokens in records.items()}
    # The rule's value 2 s after the load: its 1 m window holds the whole run.
    result = stack.prometheus.query("tenant:weighbridge_token_share:ratio_rate1m",
                                    at_unix_s=stack.end_unix_s + 2)
    got = {r["metric"]["tenant"]: float(r["value"][1]) for r in result}
    assert set(got) == set(KEYS)
    for tenant in KEYS:
        assert got[tenant] == pytest.approx(expected[tenant], abs=0.02), (got, expected)
