"""/v1/embeddings through the sidecar, in process (aiohttp test servers for the sidecar and
an emulator): an embeddings request costs its input tokens, generates nothing, never streams,
and settles its tenant's limits with the backend's ``usage``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.metrics import parse as parse_metrics
from tests.support.stack import auth
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config

KEY = "sk-embed"
# A month's bucket refills 1/2,592,000 of itself per second: no refill blurs the charge.
TOKENS_PER_MONTH = 10_000


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    engine = Emulator(EmulatorSettings(), get_profile("cpu-tiny"))
    async with TestServer(engine.app) as backend:
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"],
                              "limits": {"tokens_per_month": TOKENS_PER_MONTH}}},
            "backends": [{"url": str(backend.make_url("")).rstrip("/")}],
            "admin_api_keys": ["plain:admin"],
        })
        async with TestClient(TestServer(Sidecar(config).app)) as c:
            yield c


async def admin_state(client: TestClient[Any, Any]) -> dict[str, Any]:
    response = await client.get("/admin/state", headers=auth("admin"))
    assert response.status == 200
    return dict(await response.json())


@pytest.mark.parametrize("stream", [False, True])
async def test_an_embeddings_request_costs_its_input_tokens(client: TestClient[Any, Any],
                                                            stream: bool) -> None:
    inputs = [[5] * 40, [6] * 24]
    response = await client.post("/v1/embeddings", headers=auth(KEY),
                                 json={"input": inputs, "stream": stream})
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"  # never a stream
    body = await response.json()
    assert len(body["data"]) == 2 and body["usage"]["prompt_tokens"] == 64
    state = await admin_state(client)
    bucket = state["rate_limits"]["tenants"]["t"]["tokens_per_month"]
    # Charged 64 input + 0 expected output at admission; usage settles it at 64.
    assert bucket["level"] == pytest.approx(TOKENS_PER_MONTH - 64, abs=0.1)
    metrics = parse_metrics(await (await client.get("/metrics")).text())
    assert metrics.total("weighbridge_requests_completed_total", tenant="t") == 1
    assert metrics.total("weighbridge_tokens_served_total", tenant="t", kind="prompt") == 64
    assert metrics.total("weighbridge_tokens_served_total", tenant="t", kind="output") == 0


async def test_a_bad_input_is_the_sidecar_s_400(client: TestClient[Any, Any]) -> None:
    response = await client.post("/v1/embeddings", headers=auth(KEY), json={"input": []})
    assert response.status == 400
    assert response.headers["x-weighbridge-reject-reason"] == "invalid_prompt"
    assert "input" in (await response.json())["error"]["message"]
