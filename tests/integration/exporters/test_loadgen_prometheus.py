"""Issue 5, acceptance 1 and 2 for the load generator: a real Locust run (``locust -f
scenarios/`` with its exporter) through the sidecar to the emulator, scraped with both by a
real Prometheus with the project's rules files:

* every load-generator series docs/metrics.md documents exists in Prometheus with its labels,
  and every load-generator recording rule evaluates;
* on a steady run the Little's Law ratio, from the exporter and from the recording rule, lies
  within [0.9, 1.1] at request and token level for every tenant;
* on the same run with the test-only fault ``--test-drop-every 4`` (the exporter never hears
  of every fourth finished request, as if the generator lost it) the check departs from 1:
  the check can fail.

The two runs go on side by side through one engine, sidecar and Prometheus (one stack for
the module): the faulty generator sends as other tenants (``gamma``, ``delta``, the same
traffic as ``alpha``, ``beta``), so the rules, which sum by tenant, keep the two apart. Both
are steady (the load of both together stays well below the engine's capacity: 20 requests/s
of at most 304 tokens against 64 sequences, so nothing queues without bound and L = λW holds
over the window). Queries run while the load goes on: a stopped exporter's series go stale
in Prometheus at once.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from tests.support import locust
from tests.support.prometheus import (
    PrometheusApi,
    ScrapeTarget,
    prometheus_process,
    rule_files,
)
from weighbridge.launch import emulator_process, free_port, sidecar_process

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "metrics.md"
RULES = REPO / "deploy" / "prometheus" / "rules" / "loadgen.yml"
SETTLE_S = 20.0  # load before the checks: the windows fill with completed requests
TENANTS = ("alpha", "beta")
LOSSY_TENANTS = {"alpha": "gamma", "beta": "delta"}  # the faulty generator's names for them

TENANTS_FILE = """
tenants:
  - name: alpha
    api_key: sk-alpha-ll
    tier: standard
    weight: 2
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 64, high: 256}
      output: {kind: uniform, low: 16, high: 48}
    arrival: {kind: poisson, rate: 6}
  - name: beta
    api_key: sk-beta-ll
    tier: interactive
    endpoint: chat
    lengths:
      prompt: {kind: uniform, low: 32, high: 128}
      output: {kind: uniform, low: 8, high: 32}
    arrival: {kind: poisson, rate: 4}
"""
SIDECAR = {
    "tenants": {"alpha": {"tier": "standard", "weight": 2.0, "api_keys": ["plain:sk-alpha-ll"]},
                "beta": {"tier": "interactive", "api_keys": ["plain:sk-beta-ll"]},
                "gamma": {"tier": "standard", "weight": 2.0, "api_keys": ["plain:sk-gamma-ll"]},
                "delta": {"tier": "interactive", "api_keys": ["plain:sk-delta-ll"]}},
    "admission": {"metrics_poll_ms": 100},
}


def lossy_tenants_file() -> str:
    text = TENANTS_FILE
    for tenant, renamed in LOSSY_TENANTS.items():
        text = text.replace(tenant, renamed)
    return text


def documented_loadgen_families() -> dict[str, set[str]]:
    """name -> labels of the rows under "## Load generator" in docs/metrics.md; histograms
    by their ``_count`` series (a histogram has no bare series)."""
    text = DOCS.read_text()
    section = re.search(r"^## Load generator.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/metrics.md has no load generator section"
    families = {}
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`weighbridge_") or cells[1] not in (
                "counter", "gauge", "histogram"):
            continue
        name = cells[0].strip("`")
        if cells[1] == "histogram":
            name += "_count"
        families[name] = {x.strip() for x in cells[2].split(",") if x.strip() not in ("", "\u2013")}
    assert families
    return families


def recorded_rules() -> set[str]:
    return set(re.findall(r"^\s*- record:\s*(\S+)", RULES.read_text(), re.M))


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusApi]:
    """Emulator, sidecar, Prometheus and two Locust runs of the steady scenario, the honest
    one with this module's tenants and the faulty one (``--test-drop-every 4``) with their
    renamed twins; yields the Prometheus API once the load has run SETTLE_S seconds."""
    tmp = tmp_path_factory.mktemp("loadgen-prometheus")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(emulator_process(
            name="ll-engine", max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=4096,
            max_model_len=1024, profile="h100-llama3-8b"))
        sidecar = stack.enter_context(sidecar_process(
            {**SIDECAR, "backends": [{"url": engine.url, "name": "e0"}]}, name="ll-sidecar",
            config_dir=tmp))
        ports = {"honest": free_port(), "lossy": free_port()}
        targets = [ScrapeTarget("vllm", engine.url),
                   ScrapeTarget("weighbridge-sidecar", sidecar.url),
                   *(ScrapeTarget(f"weighbridge-loadgen-{run}", f"http://127.0.0.1:{port}")
                     for run, port in ports.items())]
        (tmp / "prometheus").mkdir()
        server = stack.enter_context(prometheus_process(
            targets, rule_files(), interval_s=1.0, directory=tmp / "prometheus"))
        api = PrometheusApi(server.url)
        stack.callback(api.close)
        for run, text, extra in (("honest", TENANTS_FILE, []),
                                 ("lossy", lossy_tenants_file(), ["--test-drop-every", "4"])):
            tenants = tmp / f"tenants-{run}.yaml"
            tenants.write_text(text)
            stack.enter_context(locust.process(
                sidecar.url, tmp / f"run-{run}", "120s", ports[run], tmp / f"locust-{run}.log",
                "--tenants-file", str(tenants), "--seed", "5", *extra))
        api.wait_until_up([t.job for t in targets])
        time.sleep(SETTLE_S)
        yield api


def ratios(api: PrometheusApi, expr: str, tenants: Iterable[str]
           ) -> dict[tuple[str, str], float]:
    """The request and token levels' ratios; the program level, which these tenants (no
    agent programs) have from the first scrape, holds nothing: 0/0."""
    wanted = set(tenants)
    found = {(r["metric"]["tenant"], r["metric"]["level"]): float(r["value"][1])
             for r in api.query(expr) if r["metric"].get("tenant") in wanted}
    programs = {key: value for key, value in found.items() if key[1] == "program"}
    assert all(math.isnan(value) for value in programs.values()), programs
    return {key: value for key, value in found.items() if key[1] != "program"}


def test_steady_run_in_prometheus(prometheus: PrometheusApi) -> None:
    api = prometheus
    missing = []
    for name, labels in documented_loadgen_families().items():
        series = api.series(name)
        if not series:
            missing.append(name)
            continue
        seen = set().union(*(s.keys() for s in series)) - {"__name__", "job", "instance"}
        assert labels <= seen, (name, labels, seen)
    assert not missing, f"documented but absent in Prometheus: {missing}"
    empty = [rule for rule in sorted(recorded_rules()) if not api.query(rule)]
    assert not empty, f"recording rules without a result: {empty}"
    exporter = ratios(api, "weighbridge_littles_law_ratio", TENANTS)
    rule = ratios(api, "tenant_level:weighbridge_littles_law_ratio:rate1m", TENANTS)
    print(f"\n[little's law, steady] exporter {exporter}; recording rule {rule}")
    wanted = {(t, level) for t in TENANTS for level in ("request", "token")}
    assert set(exporter) == wanted and set(rule) == wanted
    for key in wanted:
        assert 0.9 <= exporter[key] <= 1.1, (key, exporter[key])
        assert 0.9 <= rule[key] <= 1.1, (key, rule[key])


def test_a_generator_that_loses_requests_fails_the_check(prometheus: PrometheusApi) -> None:
    lossy = LOSSY_TENANTS.values()
    exporter = ratios(prometheus, "weighbridge_littles_law_ratio", lossy)
    rule = ratios(prometheus, "tenant_level:weighbridge_littles_law_ratio:rate1m", lossy)
    print(f"\n[little's law, a quarter of the ends lost] exporter {exporter}; rule {rule}")
    wanted = {(t, level) for t in lossy for level in ("request", "token")}
    assert set(exporter) == wanted and set(rule) == wanted
    # Lost ends never leave the in-flight count: L keeps growing while λW misses a quarter.
    for key, value in exporter.items():
        assert value > 1.2, (key, value)
    for key, value in rule.items():
        assert value > 1.2, (key, value)
