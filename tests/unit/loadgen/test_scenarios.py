"""The scenarios folder: every scenario loads, Locust finds exactly one User and one Shape,
and the noisy-neighbour tenants match the example sidecar config."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest

from weighbridge.loadgen.scenario import Phase, Scenario, ScenarioError, discover_scenarios
from weighbridge.sidecar.config import load_config

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "scenarios"
LOCUSTFILE = SCENARIOS / "locustfile.py"


def test_every_scenario_loads_and_validates() -> None:
    found = discover_scenarios(SCENARIOS, [LOCUSTFILE])
    assert set(found) == {"noisy_neighbour", "tiers", "bimodal", "steady", "burst",
                          "multi_model", "chat_sessions", "noisy_neighbour_sessions",
                          "agent_programs"}
    for scenario in found.values():
        workload = scenario.workload()
        assert workload.tenants
        # Sized for about a minute by default.
        assert 30 <= workload.end_s <= 90, scenario.name


def test_only_the_locustfile_defines_classes() -> None:
    """Locust imports every .py in the folder; a second User or Shape class anywhere would
    make it pick one silently."""
    for path in SCENARIOS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        assert classes == [], f"{path} defines {classes}"


def test_noisy_neighbour_floods_10000_requests() -> None:
    workload = discover_scenarios(SCENARIOS, [LOCUSTFILE])["noisy_neighbour"].workload()
    flooder = next(t for t in workload.tenants if t.name == "flooder")
    assert flooder.arrival is None and flooder.arrival_in("flood").count == 10_000
    assert [p.name for p in workload.phases] == ["quiet", "flood", "recovery"]


def test_multi_model_puts_tenants_on_two_models_and_an_adapter_and_floods_one() -> None:
    scenario = discover_scenarios(SCENARIOS, [LOCUSTFILE])["multi_model"]
    workload = scenario.workload()
    models = {t.name: t.model for t in workload.tenants}
    assert models == {"app-a": "model-a", "app-b": "model-b", "tuned-a": "model-a-lora",
                      "flooder-a": "model-a"}
    assert workload.victim == "app-a"
    assert [p.name for p in workload.phases] == ["quiet", "flood", "recovery"]
    flooder = next(t for t in workload.tenants if t.name == "flooder-a")
    assert flooder.arrival is None and flooder.arrival_in("flood").count == 1200
    steady = [t for t in workload.tenants if t.name != "flooder-a"]
    assert all(t.arrival is not None and not t.phases for t in steady)


def test_noisy_neighbour_names_its_victim_when_the_tenants_have_it(tmp_path: Path) -> None:
    scenario = discover_scenarios(SCENARIOS, [LOCUSTFILE])["noisy_neighbour"]
    assert scenario.workload().victim == "victim"
    other = tmp_path / "tenants.yaml"
    other.write_text("tenants:\n  - {name: solo, api_key: k, tier: standard, endpoint: "
                     "completions, lengths: {prompt: {kind: fixed, value: 8}, output: "
                     "{kind: fixed, value: 8}}, arrival: {kind: poisson, rate: 1}}\n")
    assert scenario.workload(tenants_file=other).victim is None


def test_noisy_neighbour_keys_match_the_sidecar_example() -> None:
    workload = discover_scenarios(SCENARIOS, [LOCUSTFILE])["noisy_neighbour"].workload()
    config = load_config(REPO / "deploy/examples/noisy-neighbour-sidecar.yaml")
    for tenant in workload.tenants:
        configured = config.tenants[tenant.name]
        digest = hashlib.sha256(tenant.api_key.encode()).hexdigest()
        assert digest in {k.digest for k in configured.api_keys}, tenant.name
        assert configured.tier == tenant.tier


def test_scenario_definition_errors() -> None:
    with pytest.raises(ScenarioError, match="only the last phase"):
        Scenario("x", "", (Phase("a", None), Phase("b", 1.0)), Path("t.yaml"))
    with pytest.raises(ScenarioError, match="unique"):
        Scenario("x", "", (Phase("a", 1.0), Phase("a", 1.0)), Path("t.yaml"))
    scenario = discover_scenarios(SCENARIOS, [LOCUSTFILE])["steady"]
    with pytest.raises(ScenarioError, match="--scale"):
        scenario.workload(scale=0)


def test_scale_and_stretch() -> None:
    scenario = discover_scenarios(SCENARIOS, [LOCUSTFILE])["noisy_neighbour"]
    workload = scenario.workload(scale=0.2, stretch=0.5)
    assert workload.end_s == 30.0
    flooder = next(t for t in workload.tenants if t.name == "flooder")
    assert flooder.arrival_in("flood").count == 2000
    infos = workload.phase_infos(run_end_s=20.0)
    assert [(p.name, p.start_s, p.end_s) for p in infos] == [
        ("quiet", 0.0, 7.5), ("flood", 7.5, 17.5), ("recovery", 17.5, 20.0)]
