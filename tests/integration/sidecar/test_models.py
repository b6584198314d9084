"""Two emulated models behind one sidecar, one of them with a LoRA adapter: the sidecar
learns who serves what from /v1/models, routes each request to a backend serving its
`model`, answers vLLM's 404 for a model none serves, and keeps the pools apart, so that a
flood on one model leaves another model's tenant unaffected (docs/sidecar.md, Several
models and adapters)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from tests.support import loopback
from tests.support.answers import assert_served
from tests.support.ledger import admin_state, settled
from tests.support.metrics import scrape
from tests.support.stack import ADMIN_KEY, auth, completion, start_emulator, start_sidecar, tenant
from tests.support.wait import await_for

pytestmark = pytest.mark.timeout(120)

MODEL_A, ADAPTER, MODEL_B = "model-a", "model-a-sql", "model-b"
# A month's bucket refills 1/2,592,000 of itself per second: no refill blurs the charge.
TOKENS_PER_MONTH = 10_000


class Fleet:
    def __init__(self, sidecar: str, a: str, b: str) -> None:
        self.sidecar, self.a, self.b = sidecar, a, b


@pytest.fixture(scope="module")
def fleet(processes: contextlib.ExitStack) -> Fleet:
    # 20 tokens/s per sequence and 2 sequences on model-a: a flood there queues for long.
    a = start_emulator(processes, model_name=MODEL_A, enable_lora=True,
                       lora_modules=[f"{ADAPTER}=/adapters/sql"], max_num_seqs=2, t_fixed=0.05)
    b = start_emulator(processes, model_name=MODEL_B)
    sidecar = start_sidecar(processes, {
        "tenants": {"flood": tenant("standard", "sk-flood", limits={"max_queued": 200}),
                    "victim": tenant("standard", "sk-victim"),
                    "other": tenant("standard", "sk-other"),
                    "embedder": tenant("standard", "sk-embedder",
                                       limits={"tokens_per_month": TOKENS_PER_MONTH})},
        "backends": [{"url": a.url, "name": "engine-a"}, {"url": b.url, "name": "engine-b"}],
        # Two in flight per backend, so that the flood queues in the sidecar from the start
        # rather than once the engine's slots are learned.
        "admission": {"max_inflight_per_backend": 2, "max_running_per_backend": 2},
        # No SLO: the flood must queue for minutes, which the default standard tier's 10 s
        # end-to-end deadline turns away at arrival once model-a's 20 tokens/s are measured.
        "tiers": {"standard": {"rank": 1}},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    return Fleet(sidecar.url, a.url, b.url)


def post(fleet: Fleet, key: str, body: dict[str, object]) -> httpx.Response:
    return loopback.post(fleet.sidecar + "/v1/completions", json=body, headers=auth(key),
                      timeout=30)


def test_the_fleet_lists_every_model_and_adapter_once(fleet: Fleet) -> None:
    response = loopback.get(fleet.sidecar + "/v1/models", headers=auth("sk-other"), timeout=10)
    assert response.status_code == 200
    cards = {card["id"]: card for card in response.json()["data"]}
    assert list(cards) == [MODEL_A, ADAPTER, MODEL_B]
    assert cards[ADAPTER]["parent"] == MODEL_A
    assert len(response.json()["data"]) == 3


def test_each_request_reaches_a_backend_serving_its_model(fleet: Fleet) -> None:
    for model, backend in ((MODEL_A, "engine-a"), (ADAPTER, "engine-a"), (MODEL_B, "engine-b")):
        for stream in (False, True):
            response = post(fleet, "sk-other", completion(model=model, stream=stream))
            assert_served(response, "other", backend)
            if not stream:
                assert response.json()["model"] == model
    # Without `model`: what vLLM serves it with, the first backend's first model.
    assert_served(post(fleet, "sk-other", completion()), "other", "engine-a")
    settled(fleet.sidecar)


def test_a_model_no_backend_serves_is_vllm_s_404(fleet: Fleet) -> None:
    direct = loopback.post(fleet.b + "/v1/completions", json=completion(model="no-such"),
                        timeout=10)
    response = post(fleet, "sk-other", completion(model="no-such"))
    assert response.status_code == direct.status_code == 404
    assert response.headers["x-weighbridge-reject-reason"] == "model_not_found"
    error, vllm = response.json()["error"], direct.json()["error"]
    assert {k: error[k] for k in ("type", "param", "code")} == {
        k: vllm[k] for k in ("type", "param", "code")}
    assert "no-such" in error["message"]
    settled(fleet.sidecar)


async def test_a_flood_on_one_model_leaves_another_model_s_tenant_alone(fleet: Fleet) -> None:
    """The flood fills model-a's two sequences and queues in the sidecar for minutes; the
    victim's requests to model-b are served while it still waits. No time is asserted:
    the victim's answers arriving while the flood is still queued is the proof."""
    async with httpx.AsyncClient(timeout=120) as client:
        flood = [asyncio.ensure_future(client.post(
            fleet.sidecar + "/v1/completions", json=completion(400, model=MODEL_A),
            headers=auth("sk-flood"))) for _ in range(40)]

        def flood_queued() -> int:
            pools = admin_state(fleet.sidecar)["pools"]
            return sum(p["scheduler"]["queued"] for p in pools if p["backends"] == ["engine-a"])

        await await_for(lambda: flood_queued() >= 30, what="the flood queued on model-a")
        for _ in range(5):
            response = await client.post(fleet.sidecar + "/v1/completions",
                                         json=completion(8, model=MODEL_B),
                                         headers=auth("sk-victim"))
            assert_served(response, "victim", "engine-b")
        assert await asyncio.to_thread(flood_queued) >= 20  # the flood still waits
        state = await asyncio.to_thread(admin_state, fleet.sidecar)
        assert {tuple(p["backends"]): p["models"] for p in state["pools"]}[("engine-a",)] == [
            MODEL_A, ADAPTER]
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    await await_for(lambda: admin_state(fleet.sidecar)["ledger"]["total"]["queued"] == 0,
                    what="the flood's cancellation")
    settled(fleet.sidecar)


def test_embeddings_through_the_sidecar_cost_their_input_tokens(fleet: Fleet) -> None:
    for model, backend in ((MODEL_B, "engine-b"), (ADAPTER, "engine-a")):
        response = loopback.post(fleet.sidecar + "/v1/embeddings", headers=auth("sk-embedder"),
                              json={"model": model, "input": [[5] * 40, [6] * 24]}, timeout=30)
        assert_served(response, "embedder", backend)
        body = response.json()
        assert body["model"] == model and len(body["data"]) == 2
        assert body["usage"]["prompt_tokens"] == 64
    settled(fleet.sidecar)
    bucket = admin_state(fleet.sidecar)["rate_limits"]["tenants"]["embedder"]
    # Charged 64 input + 0 expected output at admission, settled to the usage's 64, twice.
    assert bucket["tokens_per_month"]["level"] == pytest.approx(TOKENS_PER_MONTH - 128, abs=0.5)
    metrics = scrape(fleet.sidecar)
    assert metrics.total("weighbridge_tokens_served_total", tenant="embedder",
                         kind="prompt") == 128
    assert metrics.total("weighbridge_tokens_served_total", tenant="embedder",
                         kind="output") == 0


def test_metrics_say_which_backend_serves_which_model(fleet: Fleet) -> None:
    before = scrape(fleet.sidecar).by("weighbridge_model_requests_arrived_total", "model")
    for model in (MODEL_A, ADAPTER, MODEL_B):
        assert_served(post(fleet, "sk-other", completion(model=model)), "other")
    settled(fleet.sidecar)
    metrics = scrape(fleet.sidecar)
    served = {(got["backend"], got["model"])
              for got, _ in metrics.samples["weighbridge_backend_model_info"]}
    assert served == {("engine-a", MODEL_A), ("engine-a", ADAPTER), ("engine-b", MODEL_B)}
    arrived = metrics.by("weighbridge_model_requests_arrived_total", "model")
    assert {m: arrived[m] - before.get(m, 0) for m in (MODEL_A, ADAPTER, MODEL_B)} == {
        MODEL_A: 1, ADAPTER: 1, MODEL_B: 1}
    completed = metrics.by("weighbridge_model_requests_ended_total", "model",
                           outcome="completed")
    assert all(completed[m] >= 1 for m in (MODEL_A, ADAPTER, MODEL_B))
