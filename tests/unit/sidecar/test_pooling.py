"""vLLM's pooling endpoints through the sidecar, in process (aiohttp test servers for the
sidecar and an emulator): /rerank, /score, /pooling and /classify on every path vLLM serves
them, each costing its input tokens (every query and document, or every input), generating
nothing, never streaming, forwarded to its kind's own path, and settling its tenant's limits
with the backend's ``usage``. A kind's limits hold on all of its paths."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.metrics import parse as parse_metrics
from tests.support.stack import auth
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.endpoints import EndpointKind
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config

KEY = "sk-rank"
# A month's bucket refills 1/2,592,000 of itself per second: no refill blurs the charge.
TOKENS_PER_MONTH = 100_000
RERANKS_PER_MINUTE = 2
QUERY, DOCUMENTS = "which train leaves first", ["the 8:05 to Leeds", "a timetable", "tea"]
BODIES: dict[EndpointKind, dict[str, Any]] = {
    EndpointKind.RERANK: {"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
    EndpointKind.SCORE: {"text_1": QUERY, "text_2": DOCUMENTS},
    EndpointKind.POOLING: {"input": [[7] * 12, [8] * 30]},
    EndpointKind.CLASSIFY: {"messages": [{"role": "user", "content": QUERY}]},
}
PATHS = [(kind, path) for kind in BODIES for path in kind.paths]


class Served:
    """The paths the backend was sent requests on, in order (not the sidecar's probes)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def record(self, request: web.Request, _response: web.StreamResponse) -> None:
        if request.method == "POST":
            self.paths.append(request.path)


@pytest.fixture
async def served() -> Served:
    return Served()


@pytest.fixture
async def client(served: Served) -> AsyncIterator[TestClient[Any, Any]]:
    engine = Emulator(EmulatorSettings(), get_profile("cpu-tiny"))
    engine.app.on_response_prepare.append(served.record)
    async with TestServer(engine.app) as backend:
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"],
                              "limits": {"tokens_per_month": TOKENS_PER_MONTH}}},
            "endpoints": {"/rerank": {"tenant_limits": {
                "requests_per_minute": RERANKS_PER_MINUTE}}},
            "backends": [{"url": str(backend.make_url("")).rstrip("/")}],
            "admin_api_keys": ["plain:admin"],
        })
        async with TestClient(TestServer(Sidecar(config).app)) as c:
            yield c


async def tokens_left(client: TestClient[Any, Any]) -> float:
    response = await client.get("/admin/state", headers=auth("admin"))
    assert response.status == 200
    buckets = (await response.json())["rate_limits"]["tenants"]
    if "t" not in buckets:
        return TOKENS_PER_MONTH  # no bucket in use yet: nothing was charged
    return float(buckets["t"]["tokens_per_month"]["level"])


@pytest.mark.parametrize(("kind", "path"), PATHS, ids=[p for _, p in PATHS])
async def test_each_costs_its_input_tokens_and_goes_to_its_kind_s_path(
        client: TestClient[Any, Any], served: Served, kind: EndpointKind, path: str) -> None:
    response = await client.post(path, headers=auth(KEY), json={**BODIES[kind],
                                                                 "stream": True})
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"  # never a stream
    body = await response.json()
    prompt = body["usage"]["prompt_tokens"]
    assert prompt > 0 and body["usage"]["total_tokens"] == prompt
    assert served.paths == [kind.value]  # the kind's own path, whatever the client's
    # Charged its estimated input and no output at admission; the usage settles it.
    assert await tokens_left(client) == pytest.approx(TOKENS_PER_MONTH - prompt, abs=0.1)
    metrics = parse_metrics(await (await client.get("/metrics")).text())
    assert metrics.total("weighbridge_requests_completed_total", tenant="t") == 1
    assert metrics.total("weighbridge_tokens_served_total", tenant="t", kind="prompt") == prompt
    assert metrics.total("weighbridge_tokens_served_total", tenant="t", kind="output") == 0


async def test_a_limit_on_rerank_holds_on_all_three_of_its_paths(
        client: TestClient[Any, Any]) -> None:
    answers = []
    for path in EndpointKind.RERANK.paths:
        response = await client.post(path, headers=auth(KEY), json=BODIES[EndpointKind.RERANK])
        answers.append((response.status, response.headers.get("x-weighbridge-reject-reason")))
    assert answers[:RERANKS_PER_MINUTE] == [(200, None)] * RERANKS_PER_MINUTE
    assert answers[RERANKS_PER_MINUTE:] == [(429, "rate_limited")]
    # Another kind is not limited by it.
    score = await client.post("/v1/score", headers=auth(KEY), json=BODIES[EndpointKind.SCORE])
    assert score.status == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/rerank", {"documents": ["a"]}),
    ("/v2/rerank", {"query": ["a"], "documents": ["b"]}),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
    ("/pooling", {"input": []}),
    ("/classify", {"input": [-1]}),
])
async def test_what_vllm_would_refuse_is_the_sidecar_s_400_before_any_budget(
        client: TestClient[Any, Any], served: Served, path: str, body: dict[str, Any]) -> None:
    response = await client.post(path, headers=auth(KEY), json=body)
    assert response.status == 400
    assert response.headers["x-weighbridge-reject-reason"] == "invalid_prompt"
    assert served.paths == []  # the backend never saw it
    assert await tokens_left(client) == pytest.approx(TOKENS_PER_MONTH, abs=0.1)
    metrics = parse_metrics(await (await client.get("/metrics")).text())
    assert metrics.total("weighbridge_requests_rejected_total", tenant="t",
                         reason="invalid_prompt") == 1
