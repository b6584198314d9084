"""Embeddings in virtual time. The simulator's engines make a request's sequences with the
live emulator's own rule (``emulator/intake.py``'s ``engine_sequences``), so an embeddings
tenant gets the emulator's answers: 200, its prompt tokens as the emulator counts them, no
output tokens. Checked against the emulator's HTTP handlers in process, on the bodies the
load generator sends."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from weighbridge.app.simulation.clients import WorkloadClients, client_request
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation, engine_request, prompt_ids
from weighbridge.emulator.engine import Sequence
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.loadgen.arrivals import Poisson
from weighbridge.loadgen.bodies import build_body
from weighbridge.loadgen.plan import plan_request
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.config import parse_config

OPTIONS = EmulatorOptions(profile="h100-llama3-8b", max_num_seqs=8, max_num_batched_tokens=512,
                          num_kv_blocks=1024, max_model_len=4096, scheduling_policy="priority")
END_S = 12.0


def _tenant(name: str, endpoint: str, rate: float = 4.0, **fields: Any) -> TenantSpec:
    return TenantSpec.model_validate({
        "name": name, "api_key": f"sk-{name}", "endpoint": endpoint,
        "arrival": Poisson(rate=rate),
        "lengths": {"prompt": {"kind": "lognormal", "median": 300, "sigma": 0.6},
                    "output": 48},
        **fields})


def _emulator() -> Emulator:
    return Emulator(EmulatorSettings(model_name=OPTIONS.model_name, engine=OPTIONS.engine(),
                                     seed=OPTIONS.seed,
                                     mean_output_tokens=OPTIONS.mean_output_tokens),
                    OPTIONS.step_profile())


def _run(*tenants: TenantSpec) -> dict[str, Any]:
    """The records of a simulated run of ``tenants``, by request id."""
    config = parse_config({
        "tenants": {t.name: {"tier": "standard", "api_keys": [f"plain:sk-{t.name}"]}
                    for t in tenants},
        "backends": [{"name": "engine-0", "url": "http://127.0.0.1:9"}],
    })
    workload = Workload(scenario="embeddings", phases=(PhaseSpan("load", 0.0, END_S),),
                        tenants=tenants)
    result = Simulation(config, [SimEngine("engine-0", OPTIONS)],
                        WorkloadClients(workload, seed=0, until_s=END_S),
                        run_id="embeddings", scenario="embeddings", until_s=END_S).run()
    return {r.request_id: r for r in result.records}


async def test_an_embeddings_tenant_gets_the_emulator_s_answers() -> None:
    embedder = _tenant("embedder", "embeddings")
    writer = _tenant("writer", "completions", rate=2.0)
    records = _run(embedder, writer)
    embedded = [r for r in records.values() if r.tenant == "embedder"]
    ok = [r for r in embedded if r.status == "ok"]
    # Every one is answered, but those the run's end cuts off (none failed with a 400).
    assert len(ok) > 30
    assert all(r.reason == "run_ended" for r in embedded if r.status != "ok")
    assert {(r.http_status, r.output_tokens, r.endpoint) for r in ok} == {
        (200, 0, "/v1/embeddings")}
    assert any(r.status == "ok" and r.output_tokens == 48 for r in records.values()
               if r.tenant == "writer")  # beside a tenant that generates

    # The emulator answers the body the load generator sends for each plan with the same
    # usage the simulated record kept.
    emulator = _emulator()
    async with TestClient(TestServer(emulator.app)) as client:
        for r in ok[:10]:
            plan = plan_request(embedder, r.request_id, "load", r.scheduled_s, 0)
            response = await client.post("/v1/embeddings", data=build_body(plan, embedder),
                                         headers={"Content-Type": "application/json"})
            assert response.status == 200
            usage = (await response.json())["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
                r.prompt_tokens, r.output_tokens)
            assert r.prompt_tokens == plan.prompt_tokens


def _as_the_engine_runs_it(seq: Sequence, request_id: str) -> tuple[Any, ...]:
    """What the step model reads of a sequence (its id after the request's own)."""
    return (seq.request_id.removeprefix(request_id), seq.prompt_tokens,
            seq.target_output_tokens, seq.max_tokens, seq.pooling, seq.priority, seq.lora,
            seq.prompt_ids)


@pytest.mark.parametrize("tenant", [
    _tenant("embedder", "embeddings", priority=2),
    # A system prompt: the simulator then knows the prompt's ids, as the body sends them
    # (a prefix-free prompt's content is its own there, None: the same to the cache).
    _tenant("writer", "completions", priority=3, ignore_eos=False, stream=False,
            system_prompt={"length": 40}),
], ids=["embeddings", "completions"])
async def test_the_live_emulator_and_the_simulator_make_the_same_sequences(
        tenant: TenantSpec) -> None:
    plan = plan_request(tenant, f"{tenant.name}-0", "load", 0.0, 0)
    emulator = _emulator()
    submitted: list[Sequence] = []
    submit = emulator.runner.submit

    def spy(seq: Sequence, *, interval: int = 1) -> Any:
        submitted.append(seq)
        return submit(seq, interval=interval)

    emulator.runner.submit = spy  # type: ignore[method-assign]
    async with TestClient(TestServer(emulator.app)) as client:
        response = await client.post(tenant.path, data=build_body(plan, tenant),
                                     headers={"Content-Type": "application/json"})
        assert response.status == 200
        live_id = (await response.json())["id"]

    engine = SimEngine("engine-0", OPTIONS)
    simulated = engine.sequences(
        engine_request(client_request(tenant, plan), engine.served_model, tenant.priority,
                       prompt_ids(plan)),
        plan.request_id, 0.0)
    live = [_as_the_engine_runs_it(s, live_id) for s in submitted]
    assert live == [_as_the_engine_runs_it(s, plan.request_id) for s in simulated]
    assert len(live) == 1 and live[0][5] == tenant.priority
    assert live[0][4] == (tenant.endpoint == "embeddings")
