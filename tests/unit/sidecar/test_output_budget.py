"""The sidecar limits and charges the output the engine will generate, read as vLLM reads it
(weighbridge.output_budget): ``max_completion_tokens`` over ``max_tokens`` in chat, 16 for a
completion that names none, ``n`` answers each with the budget; and ``max_tokens_limit`` is
forwarded as the budget of a request that names none. In process: the real ``Sidecar`` app
in front of a stub backend that records every forwarded body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.stack import auth
from tests.support.stub_backend import StubBackend
from weighbridge.output_budget import COMPLETIONS_DEFAULT_MAX_TOKENS
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.estimator import OutputEstimator

KEY = "sk-budget"
LIMIT = 64
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Served:
    client: TestClient[Any, Any]
    stub: StubBackend
    sidecar: Sidecar


def served(tokens_per_minute: int | None = None,
           limit: int | None = LIMIT) -> AsyncIterator[Served]:
    async def serve() -> AsyncIterator[Served]:
        with StubBackend() as stub:
            stub.release()
            config = parse_config({
                "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"],
                                  "limits": {"tokens_per_minute": tokens_per_minute}}},
                "backends": [{"url": stub.url}],
                "max_tokens_limit": limit,
            })
            sidecar = Sidecar(config)
            async with TestClient(TestServer(sidecar.app)) as client:
                yield Served(client, stub, sidecar)
    return serve()


@pytest.fixture
async def limited() -> AsyncIterator[Served]:
    async for s in served():
        yield s


async def post(s: Served, path: str, body: dict[str, Any]) -> int:
    response = await s.client.post(path, json=body, headers=auth(KEY))
    await response.read()
    return response.status


@pytest.mark.parametrize(("path", "body", "field"), [
    (CHAT, {"messages": MESSAGES}, "max_completion_tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": None, "max_tokens": None},
     "max_completion_tokens"),
])
async def test_a_request_without_a_budget_is_forwarded_with_the_limit(
        limited: Served, path: str, body: dict[str, Any], field: str) -> None:
    assert await post(limited, path, body) == 200
    assert limited.stub.bodies[-1][field] == LIMIT


async def test_a_completion_without_a_budget_keeps_vllm_s_default() -> None:
    async for s in served(limit=COMPLETIONS_DEFAULT_MAX_TOKENS - 1):
        # Under the default: the engine gets the limit ...
        assert await post(s, "/v1/completions", {"prompt": [1, 2]}) == 200
        assert s.stub.bodies[-1]["max_tokens"] == COMPLETIONS_DEFAULT_MAX_TOKENS - 1
    async for s in served(limit=LIMIT):
        # ... above it, vLLM's own 16 applies and nothing is added.
        assert await post(s, "/v1/completions", {"prompt": [1, 2]}) == 200
        assert "max_tokens" not in s.stub.bodies[-1]


async def test_max_completion_tokens_is_limited_whatever_max_tokens_says(
        limited: Served) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "max_completion_tokens": LIMIT + 1}
    assert await post(limited, CHAT, body) == 400
    # max_tokens above the limit is no budget vLLM reads when max_completion_tokens is set.
    body = {"messages": MESSAGES, "max_tokens": LIMIT + 1, "max_completion_tokens": 2}
    assert await post(limited, CHAT, body) == 200
    assert limited.stub.bodies[-1]["max_completion_tokens"] == 2


async def test_the_rate_limit_charges_the_budget_the_engine_generates() -> None:
    """The tenant's tokens a minute fit a 1-token answer but not the default estimate (256
    tokens, before any observation): a request whose max_tokens says 1 but whose
    max_completion_tokens says 5,000 is charged as the latter."""
    async for s in served(tokens_per_minute=100, limit=None):
        assert await post(s, CHAT, {"messages": MESSAGES, "max_tokens": 1,
                                    "max_completion_tokens": 5000}) == 429
        assert await post(s, CHAT, {"messages": MESSAGES, "max_tokens": 1}) == 200


def test_n_answers_multiply_the_estimate_and_are_learned_per_answer() -> None:
    estimator = OutputEstimator({"/v1/completions": 100})
    assert estimator.estimate("t", "/v1/completions", None, sequences=3) == 300
    assert estimator.estimate("t", "/v1/completions", 40, sequences=3) == 120
    estimator.observe("t", "/v1/completions", 50)
    assert estimator.estimate("t", "/v1/completions", None, sequences=4) == 200
