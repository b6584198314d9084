"""Repeat demotion counts a caller by the API key it authenticated with, not by the body's
``user`` field (which the client picks per request). In process: the real ``Sidecar`` app in
front of a stub backend that holds requests, with an in-flight cap of one so that the queue's
order decides who goes next."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from tests.support.stack import auth
from tests.support.stub_backend import StubBackend
from tests.support.wait import await_for
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config


async def test_a_second_request_of_the_same_key_waits_behind_another_keys_first() -> None:
    with StubBackend() as stub:
        config = parse_config({
            "tenants": {"t": {"tier": "standard",
                              "api_keys": ["plain:sk-first", "plain:sk-second"]}},
            "backends": [{"url": stub.url}],
            "scheduler": {"repeat_demotion": True},
            # The stub's /metrics fail, so the fallback cap (this) is what admission uses.
            "admission": {"max_inflight_per_backend": 1},
        })
        sidecar = Sidecar(config)
        async with TestClient(TestServer(sidecar.app)) as client:

            async def send(key: str, user: str) -> int:
                body: dict[str, Any] = {"prompt": [1, 2, 3], "max_tokens": 1, "user": user}
                response = await client.post("/v1/completions", json=body, headers=auth(key))
                await response.read()
                return response.status

            first = asyncio.create_task(send("sk-first", "alice"))
            await await_for(lambda: stub.received == 1, timeout_s=30,
                           what="the first request at the backend")
            # The same key again, under another `user`; then the tenant's other key.
            again = asyncio.create_task(send("sk-first", "somebody-else"))
            await await_for(lambda: sidecar.core.scheduler.queued_requests == 1,
                            timeout_s=30, what="the repeat queued")
            other = asyncio.create_task(send("sk-second", "bob"))
            await await_for(lambda: sidecar.core.scheduler.queued_requests == 2,
                            timeout_s=30, what="both queued")
            stub.release()
            assert await asyncio.gather(first, again, other) == [200, 200, 200]
    # The repeat was demoted although its `user` was new: the other key's request went first.
    assert [b["user"] for b in stub.bodies] == ["alice", "bob", "somebody-else"]
