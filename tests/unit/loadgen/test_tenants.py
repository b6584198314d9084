from __future__ import annotations

from pathlib import Path

import pytest

from weighbridge.loadgen.tenants import TenantsError, load_tenants, parse_tenants


def _parse(data: object) -> object:
    return parse_tenants(data, base_dir=Path("."), source="tenants.yaml")


def test_errors_name_the_file_and_the_field() -> None:
    with pytest.raises(TenantsError) as info:
        _parse({"tenants": [{"name": "a", "endpoint": "rerank",
                             "lengths": {"prompt": {"kind": "uniform", "low": 0, "high": 3},
                                         "output": 4},
                             "arrival": {"kind": "poisson", "rate": -1}}]})
    message = str(info.value)
    assert message.startswith("tenants.yaml:")
    assert "tenants.0.endpoint:" in message
    assert "tenants.0.lengths.classes.0.prompt.low:" in message
    assert "tenants.0.arrival.rate:" in message


def test_unknown_keys_and_duplicate_names_are_refused() -> None:
    with pytest.raises(TenantsError, match=r"tenants\.0\.rate: Extra inputs"):
        _parse({"tenants": [{"name": "a", "rate": 3, "lengths": {"prompt": 1, "output": 1}}]})
    with pytest.raises(TenantsError, match="repeated: a"):
        _parse({"tenants": [{"name": "a", "lengths": {"prompt": 1, "output": 1}}] * 2})


def test_phase_names_must_exist_in_the_scenario() -> None:
    tenants = _parse({"tenants": [{"name": "a", "lengths": {"prompt": 1, "output": 1},
                                   "phases": {"flod": None}}]})
    with pytest.raises(TenantsError, match=r"tenants\.0\.phases\.flod: no phase 'flod'"):
        tenants.check_phases(["quiet", "flood"])


def test_load_reports_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match="cannot read"):
        load_tenants(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [\n")
    with pytest.raises(TenantsError, match="not valid YAML"):
        load_tenants(bad)


def test_per_phase_override_and_scaling() -> None:
    tenant = _parse({"tenants": [{
        "name": "a", "lengths": {"prompt": 1, "output": 1},
        "arrival": {"kind": "poisson", "rate": 2},
        "phases": {"flood": {"kind": "burst", "count": 100}, "recovery": None}}]}).tenants[0]
    assert tenant.arrival_in("quiet").rate == 2
    assert tenant.arrival_in("flood").count == 100
    assert tenant.arrival_in("recovery") is None
    scaled = tenant.scaled(0.5)
    assert scaled.arrival_in("quiet").rate == 1
    assert scaled.arrival_in("flood").count == 50


def test_a_tenant_may_name_its_model() -> None:
    tenants = _parse({"tenants": [
        {"name": "a", "model": "model-a-lora", "lengths": {"prompt": 1, "output": 1}},
        {"name": "b", "lengths": {"prompt": 1, "output": 1}}]}).tenants
    assert [t.model for t in tenants] == ["model-a-lora", None]  # None: the run's model
    assert tenants[0].scaled(2.0).model == "model-a-lora"
    for bad in ("", "model a"):
        with pytest.raises(TenantsError, match=r"tenants\.0\.model:"):
            _parse({"tenants": [{"name": "a", "model": bad,
                                 "lengths": {"prompt": 1, "output": 1}}]})
