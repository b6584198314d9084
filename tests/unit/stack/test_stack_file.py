"""Stack files (deploy/stacks/*.yaml): parsing, errors naming their field, the sidecar config
a stack generates, and the demo's request-level baseline derived from a stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from weighbridge.app import stack as stack_module
from weighbridge.app.stack import (
    DEFAULT_STACK,
    LocalStack,
    StackError,
    StackUrls,
    baseline_stack,
    load_stack,
    parse_stack,
    sidecar_config,
)
from weighbridge.launch import LaunchError
from weighbridge.resources import SCENARIOS_DIR
from weighbridge.sidecar.admission import derive_limits
from weighbridge.sidecar.config import FAIRNESS_ADMISSION, parse_config
from weighbridge.sidecar.shape import EngineShape

STACKS = sorted((DEFAULT_STACK.parent).glob("*.yaml"))


def minimal(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "engines": {"count": 2, "emulator": {"max_num_seqs": 8}},
        "sidecar": {"tenants": {"a": {"tier": "standard", "api_keys": ["plain:k"]}}},
    }
    data.update(changes)
    return data


def errors(data: Any) -> dict[str, str]:
    with pytest.raises(StackError) as caught:
        parse_stack(data, source="test.yaml")
    assert str(caught.value).startswith("test.yaml: cannot load stack")
    return dict(caught.value.errors)


@pytest.mark.parametrize("path", [p for p in STACKS if "tenants" not in p.name],
                         ids=lambda p: p.name)
def test_every_shipped_stack_file_loads(path: Path) -> None:
    spec = load_stack(path)
    assert spec.engines.count >= 1
    config = sidecar_config(spec, [f"http://127.0.0.1:{9000 + i}"
                                   for i in range(spec.engines.count)])
    parse_config(config)  # the generated sidecar config is valid as it will be started
    if spec.tenants_file is not None:
        assert spec.tenants_file.is_file()


def test_the_default_stack_matches_its_tenants_file() -> None:
    spec = load_stack(DEFAULT_STACK)
    assert spec.tenants_file is not None
    tenants = yaml.safe_load(spec.tenants_file.read_text())["tenants"]
    config = parse_config(sidecar_config(spec, ["http://127.0.0.1:9001"]))
    for tenant in tenants:
        # Every load-generator key authenticates as the tenant of the same name.
        assert config.tenant_for_key(tenant["api_key"]) == tenant["name"]
        assert config.tenants[tenant["name"]].tier == tenant["tier"]


def test_backends_are_one_per_engine_with_priorities_when_the_engines_order_by_them() -> None:
    spec = parse_stack(minimal(engines={"count": 3,
                                        "emulator": {"scheduling_policy": "priority"}}))
    config = sidecar_config(spec, ["http://h:1", "http://h:2", "http://h:3"])
    assert [b["url"] for b in config["backends"]] == ["http://h:1", "http://h:2", "http://h:3"]
    assert [b["name"] for b in config["backends"]] == ["engine-0", "engine-1", "engine-2"]
    assert all(b["priority_scheduling"] for b in config["backends"])
    fcfs = parse_stack(minimal(engines={"emulator": {"scheduling_policy": "fcfs"}}))
    assert not any(b["priority_scheduling"]
                   for b in sidecar_config(fcfs, ["http://h:1"])["backends"])
    forced = parse_stack(minimal(engines={"priority_scheduling": False,
                                          "emulator": {"scheduling_policy": "priority"}}))
    assert not sidecar_config(forced, ["http://h:1"])["backends"][0]["priority_scheduling"]


def test_the_backends_know_the_engines_stream_interval() -> None:
    """Live charging counts a streamed chunk's tokens by the engine's --stream-interval."""
    spec = parse_stack(minimal(engines={"count": 2, "emulator": {"stream_interval": 4}}))
    config = parse_config(sidecar_config(spec, ["http://h:1", "http://h:2"]))
    assert [b.stream_interval for b in config.backends] == [4, 4]
    assert spec.engines.emulator.flags(seed_offset=0)["stream_interval"] == 4
    assert parse_config(sidecar_config(parse_stack(minimal()), ["http://h:1"])
                        ).backends[0].stream_interval == 1


def test_engine_flags_differ_only_in_seed() -> None:
    spec = parse_stack(minimal())
    first, second = (spec.engines.emulator.flags(seed_offset=i) for i in range(2))
    assert first.pop("seed") != second.pop("seed")
    assert first == second
    assert "t_fixed" not in first  # unset overrides are not passed on


def test_engines_serve_the_stacks_models_in_turn(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    spec = parse_stack(minimal(engines={"count": 3, "models": ["model-a", "model-b"],
                                        "emulator": {"max_num_seqs": 8}}))
    assert [spec.engines.model_for(i) for i in range(3)] == ["model-a", "model-b", "model-a"]
    flags = [spec.engines.emulator_for(i).flags(seed_offset=i) for i in range(3)]
    assert [f.pop("model_name") for f in flags] == ["model-a", "model-b", "model-a"]
    assert [f.pop("seed") for f in flags] == [0, 1, 2] and flags[0] == flags[1] == flags[2]
    # Without models, every engine serves emulator.model_name, as before.
    plain = parse_stack(minimal(engines={"emulator": {"model_name": "m"}}))
    assert plain.engines.models is None
    assert [plain.engines.emulator_for(i).model_name for i in range(2)] == ["m", "m"]
    assert plain.engines.emulator_for(1) is plain.engines.emulator

    # What the stack starts: one emulator per engine, each with its model.
    started: list[dict[str, object]] = []

    class Engine:
        url, log_path = "http://127.0.0.1:9", None

        def start(self) -> None:
            raise LaunchError("not started in a unit test")

        def signal(self, _signal: int) -> None:
            pass

        def stop(self) -> None:
            pass

    def fake(**kwargs: object) -> Engine:
        started.append(kwargs)
        return Engine()

    monkeypatch.setattr(stack_module, "emulator_process", fake)
    with pytest.raises(LaunchError):
        LocalStack(spec, tmp_path).start()
    assert [k["model_name"] for k in started] == ["model-a", "model-b", "model-a"]


def test_engine_model_errors_are_named() -> None:
    found = errors(minimal(engines={"count": 1, "models": ["a", "b"]}))
    assert "b would be served by no engine" in found["engines.models"]
    found = errors(minimal(engines={"models": ["a", "a"]}))
    assert "repeated: a" in found["engines.models"]
    assert "engines.models" in errors(minimal(engines={"models": []}))
    assert "engines.models.0" in errors(minimal(engines={"models": [" a"]}))
    found = errors(minimal(engines={"models": ["a"], "emulator": {"model_name": "b"}}))
    assert "set one or the other" in found["engines.emulator.model_name"]


def test_the_multi_model_stack_serves_one_model_per_engine() -> None:
    spec = load_stack(DEFAULT_STACK.parent / "multi-model.yaml")
    assert spec.loadgen.scenario == "multi_model" and spec.engines.count == 2
    assert [spec.engines.model_for(i) for i in range(2)] == ["model-a", "model-b"]
    assert spec.tenants_file is None  # the scenario's own
    tenants = yaml.safe_load((SCENARIOS_DIR / "tenants" / "multi_model.yaml").read_text())
    config = parse_config(sidecar_config(spec, ["http://h:1", "http://h:2"]))
    engines = [spec.engines.emulator_for(i) for i in range(2)]
    served = {e.model_name for e in engines} | {
        m.split("=")[0] for e in engines for m in e.lora_modules}
    for tenant in tenants["tenants"]:
        assert config.tenant_for_key(tenant["api_key"]) == tenant["name"]
        assert tenant["model"] in served  # every model it names is served
    assert engines[0].enable_lora and not engines[1].enable_lora


def test_adapters_go_to_the_engines_serving_their_base_model() -> None:
    spec = parse_stack(minimal(engines={
        "count": 3, "models": ["a", "b"], "adapters": {"a": ["a-sql=/p/sql", "a-chat=/p/c"]}}))
    flags = [spec.engines.emulator_for(i).flags(seed_offset=i) for i in range(3)]
    assert flags[0]["lora_modules"] == flags[2]["lora_modules"] == ["a-sql=/p/sql", "a-chat=/p/c"]
    assert flags[0]["enable_lora"] is True and "lora_modules" not in flags[1]
    found = errors(minimal(engines={"models": ["a"], "adapters": {"z": ["z-l=/p"]}}))
    assert "no engine serves z" in found["engines.adapters.z"]
    found = errors(minimal(engines={"models": ["a"], "adapters": {"a": ["a=/p"]}}))
    assert "conflicts" in found["engines.adapters.a"]


def test_unknown_and_mistyped_fields_are_named() -> None:
    found = errors(minimal(engines={"count": 0, "emulator": {"max_num_sqs": 8}},
                           prometheus="sometimes"))
    assert set(found) == {"engines.count", "engines.emulator.max_num_sqs", "prometheus"}


def test_sidecar_errors_carry_the_sidecar_prefix() -> None:
    found = errors(minimal(sidecar={"tenants": {"a": {"tier": "gold", "api_keys": ["k"]}},
                                    "routing": "random"}))
    assert set(found) == {"sidecar.routing", "sidecar.tenants.a.api_keys.0"}
    # Cross-field checks (run once every field is valid) are prefixed too.
    found = errors(minimal(sidecar={"tenants": {"a": {"tier": "gold",
                                                      "api_keys": ["plain:k"]}}}))
    assert "unknown tier 'gold'" in found["sidecar.tenants.a.tier"]


def test_backends_belong_to_the_stack() -> None:
    found = errors(minimal(sidecar={"backends": [{"url": "http://x:1"}]}))
    assert "set by the stack" in found["sidecar.backends"]


def test_emulator_startup_checks_run_at_load_time() -> None:
    found = errors(minimal(engines={"emulator": {"num_kv_blocks": 4, "block_size": 16,
                                                 "max_model_len": 4096}}))
    assert "smaller than max_model_len" in found["engines.emulator"]
    found = errors(minimal(engines={"emulator": {"profile": "a100"}}))
    assert "unknown profile" in found["engines.emulator"]


def test_tenants_file_is_relative_to_the_stack_file(tmp_path: Path) -> None:
    (tmp_path / "load.yaml").write_text("tenants: []\n")
    stack = tmp_path / "s.yaml"
    stack.write_text(yaml.safe_dump(minimal(loadgen={"tenants_file": "load.yaml"})))
    assert load_stack(stack).tenants_file == tmp_path / "load.yaml"
    stack.write_text(yaml.safe_dump(minimal(loadgen={"tenants_file": "missing.yaml"})))
    with pytest.raises(StackError, match=r"loadgen\.tenants_file: no such file"):
        load_stack(stack)


def test_file_errors_name_the_file_and_place(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"nothing\.yaml"):
        load_stack(tmp_path / "nothing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: {count: 2\n")
    with pytest.raises(StackError, match=r"bad.yaml:\d+:\d+"):
        load_stack(bad)
    with pytest.raises(StackError, match="must be a mapping"):
        parse_stack(["a list"])


def test_request_level_baseline_drops_every_tenant_aware_mechanism() -> None:
    spec = load_stack(DEFAULT_STACK)
    assert spec.sidecar["scheduler"]["policy"] == "drr"
    # No admission section: every knob is derived from the engines' learned shape, and the
    # derived fairness settings apply to the tenant-aware policies only.
    assert "admission" not in spec.sidecar
    base = baseline_stack(spec)
    assert base.sidecar["scheduler"]["policy"] == "fcfs"
    assert base.sidecar["routing"] == "round_robin"
    assert not set(FAIRNESS_ADMISSION) & set(base.sidecar.get("admission", {}))
    shape = EngineShape(slots=32, slots_exact=True, kv_blocks=1024, block_size=16, step_s=0.01)
    fair = derive_limits(parse_config(sidecar_config(spec, ["http://h:1"])).admission, shape)
    fifo = derive_limits(parse_config(sidecar_config(base, ["http://h:1"])).admission, shape,
                         tenant_aware=False)
    assert fair.headroom_slots and fair.kv_blocks and fair.max_prefill_tokens_inflight
    assert not (fifo.headroom_slots or fifo.kv_blocks or fifo.max_prefill_tokens_inflight
                or fifo.max_backend_prefill_tokens)
    assert fifo.max_backend_waiting == fair.max_backend_waiting  # the same gate otherwise
    assert not sidecar_config(base, ["http://h:1"])["backends"][0]["priority_scheduling"]
    # The same engines and tenants: only the sidecar's policy differs.
    assert base.engines.emulator == spec.engines.emulator
    assert base.sidecar["tenants"] == spec.sidecar["tenants"]
    assert spec.sidecar["scheduler"]["policy"] == "drr"  # the original is untouched


def test_locust_command_sends_the_stack_scenario_through_the_sidecar() -> None:
    spec = load_stack(DEFAULT_STACK)
    urls = StackUrls(sidecar="http://127.0.0.1:8000", engines=("http://127.0.0.1:8001",),
                     prometheus=None, loadgen_exporter=None)
    argv = urls.locust_command(spec)
    assert argv[:2] == ["locust", "-f"] and argv[2].endswith("scenarios/")
    assert argv[argv.index("--host") + 1] == "http://127.0.0.1:8000"
    assert argv[argv.index("--scenario") + 1] == "noisy_neighbour"
    assert Path(argv[argv.index("--tenants-file") + 1]).resolve() == spec.tenants_file
    assert "--headless" not in argv and "--headless" in urls.locust_command(spec,
                                                                          headless=True)


def test_the_stack_tells_the_sidecar_its_engines_step_budget_unless_the_stack_says_otherwise(
        ) -> None:
    # vLLM does not export --max-num-batched-tokens; the stack declares it for its engines.
    spec = parse_stack(minimal(engines={"emulator": {"max_num_batched_tokens": 384}}))
    config = parse_config(sidecar_config(spec, ["http://h:1"]))
    assert config.admission.step_budget_tokens == 384
    assert spec.sidecar.get("admission") is None  # the stack's own section is not changed
    own = parse_stack(minimal(engines={"emulator": {"max_num_batched_tokens": 384}},
                              sidecar={"admission": {"step_budget_tokens": 1024,
                                                     "headroom_slots": 1}}))
    config = parse_config(sidecar_config(own, ["http://h:1"]))
    assert config.admission.step_budget_tokens == 1024
    assert config.admission.headroom_slots == 1
