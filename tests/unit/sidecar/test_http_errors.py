"""The sidecar's HTTP error paths in process: aiohttp's test server and client in front of
the real ``Sidecar`` app, no subprocess. The backend is an address nothing listens on: every
answer here is decided before a backend is needed (or says none is healthy)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.stack import auth, completion
from weighbridge.launch import free_port
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config

KEY = "sk-http-errors"
MAX_BODY_BYTES = 4096


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    config = parse_config({
        "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
        "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],
        "max_body_bytes": MAX_BODY_BYTES,
    })
    async with TestClient(TestServer(Sidecar(config).app)) as c:
        yield c


async def error_of(response: Any, status: int, reason: str) -> dict[str, Any]:
    """The OpenAI error shape with the reject-reason header; returns the error object."""
    assert response.status == status, (response.status, await response.text())
    assert response.headers["x-weighbridge-reject-reason"] == reason
    error = (await response.json())["error"]
    assert error["code"] == reason and error["message"] and error["type"]
    return dict(error)


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/v1/completions", {"POST"}),
    ("PUT", "/v1/chat/completions", {"POST"}),
    ("POST", "/v1/models", {"GET", "HEAD"}),
    ("POST", "/healthz", {"GET", "HEAD"}),
    ("DELETE", "/readyz", {"GET", "HEAD"}),
    ("POST", "/metrics", {"GET", "HEAD"}),
    ("POST", "/admin/state", {"GET", "HEAD"}),
])
async def test_405_names_the_allowed_methods(client: TestClient[Any, Any], method: str,
                                             path: str, allowed: set[str]) -> None:
    response = await client.request(method, path, headers=auth(KEY))
    await error_of(response, 405, "method_not_allowed")
    assert {m.strip() for m in response.headers["Allow"].split(",")} == allowed


async def test_unknown_path_is_404(client: TestClient[Any, Any]) -> None:
    await error_of(await client.get("/v1/nothing", headers=auth(KEY)), 404, "not_found")


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-nobody"},
                                     {"authorization": KEY}])
async def test_no_valid_key_is_401(client: TestClient[Any, Any],
                                   headers: dict[str, str]) -> None:
    response = await client.post("/v1/completions", json=completion(), headers=headers)
    error = await error_of(response, 401, "unauthorized")
    assert error["type"] == "authentication_error"


@pytest.mark.parametrize("value", ["", "   ", "platinum"])
async def test_a_tier_header_naming_no_tier_is_400(client: TestClient[Any, Any],
                                                   value: str) -> None:
    """Empty and blank are no tier's name (sidecar/openapi.yaml: the header's pattern)."""
    response = await client.post("/v1/completions", json=completion(),
                                 headers={**auth(KEY), "x-weighbridge-tier": value})
    await error_of(response, 400, "unknown_tier")


async def test_malformed_json_is_400(client: TestClient[Any, Any]) -> None:
    response = await client.post("/v1/completions", data=b"{",
                                 headers={**auth(KEY), "content-type": "application/json"})
    await error_of(response, 400, "invalid_json")


async def test_a_body_over_the_limit_is_413(client: TestClient[Any, Any]) -> None:
    body = completion(prompt_tokens=MAX_BODY_BYTES)  # 3 bytes a token id: over the limit
    response = await client.post("/v1/completions", json=body, headers=auth(KEY))
    await error_of(response, 413, "body_too_large")
