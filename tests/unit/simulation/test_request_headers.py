"""The load generator sends the sidecar's request headers when a tenants file asks
(``ask_tier``, ``deadline_ms``), so tier requests and early rejection can be load-tested;
here through the simulation, which runs the sidecar's own code on what the generator sends."""

from __future__ import annotations

from collections import Counter

from weighbridge import headers
from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Poisson
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.config import parse_config

ENGINE = EmulatorOptions(profile="h100-llama3-8b", max_num_seqs=4, max_num_batched_tokens=512,
                         num_kv_blocks=1024)
END_S = 20.0


def _tenant(name: str, rate: float, **fields: object) -> TenantSpec:
    return TenantSpec.model_validate({
        "name": name, "api_key": f"sk-{name}", "arrival": Poisson(rate=rate),
        "lengths": Lengths.model_validate({"classes": [{"prompt": 256, "output": 128}]}),
        **fields})


def _reasons(*tenants: TenantSpec) -> dict[str, Counter[str | None]]:
    config = parse_config({
        "tenants": {t.name: {"tier": "interactive" if t.name == "vip" else "standard",
                             "api_keys": [f"plain:sk-{t.name}"]} for t in tenants},
        "backends": [{"name": "engine-0", "url": "http://127.0.0.1:9"}],
    })
    workload = Workload(scenario="headers", phases=(PhaseSpan("load", 0.0, END_S),),
                        tenants=tenants)
    records = Simulation(config, [SimEngine("engine-0", ENGINE)],
                         WorkloadClients(workload, seed=0, until_s=END_S),
                         run_id="headers", scenario="headers", until_s=END_S).run().records
    out: dict[str, Counter[str | None]] = {}
    for r in records:
        out.setdefault(r.tenant, Counter())[r.reason] += 1
    return out


def test_the_headers_a_tenants_file_asks_for() -> None:
    plain = _tenant("plain", 1.0)
    assert plain.request_headers == {}
    asking = _tenant("asking", 1.0, tier="batch", ask_tier=True, deadline_ms=250,
                     headers={"x-extra": "1"})
    assert asking.request_headers == {headers.TIER: "batch", headers.DEADLINE_MS: "250",
                                      "x-extra": "1"}


def test_a_deadline_turns_requests_away_early_and_a_tier_above_its_own_is_refused() -> None:
    # A flood far beyond a 4-sequence engine, with a 200 ms deadline: most of its requests
    # cannot start in time and are turned away at once. A standard tenant asking for the
    # interactive tier is refused every time; one asking for batch (below its own) is served.
    reasons = _reasons(
        _tenant("flood", 40.0, deadline_ms=200),
        _tenant("climber", 1.0, tier="interactive", ask_tier=True),
        _tenant("humble", 1.0, tier="batch", ask_tier=True))
    assert reasons["flood"]["deadline_unmeetable"] > reasons["flood"][None] > 0
    assert set(reasons["climber"]) == {"tier_not_allowed"}
    assert set(reasons["humble"]) <= {None, "run_ended"} and reasons["humble"][None] > 0
