"""A backend URL and a Redis URL from the configuration may carry credentials
(``http://user:password@host``, ``redis://:password@host``, ``?password=``): the sidecar
uses them and shows them nowhere — not in its log, ``/admin/state`` or ``/metrics`` (the
spans: ``test_tracing.py``). In process: the sidecar and an emulator on aiohttp test
servers, the Redis unreachable."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.stack import auth, completion
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.shared import SharedState

KEY = "sk-credentials-test"
BACKEND_SECRETS = ("backend-ops", "backend-pw-7781")
REDIS_SECRET = "redis-pw-5512"


REDIS_URLS = [f"redis://:{REDIS_SECRET}@127.0.0.1:1/0",
              f"unix:///nonexistent/weighbridge-test.sock?db=0&password={REDIS_SECRET}"]


async def test_credentials_in_urls_appear_in_no_log_state_or_metric(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    engine = Emulator(EmulatorSettings(), get_profile("cpu-tiny"))
    async with TestServer(engine.app, host="127.0.0.1") as backend:
        address = str(backend.make_url("")).rstrip("/").removeprefix("http://")
        user, password = BACKEND_SECRETS
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
            "backends": [{"url": f"http://{user}:{password}@{address}", "name": "e0"}],
            "admin_api_keys": ["plain:admin"],
            "state": {"backend": "redis", "url": REDIS_URLS[0]},
        })
        async with TestClient(TestServer(Sidecar(config).app)) as client:
            response = await client.post("/v1/completions", headers=auth(KEY),
                                         json=completion(2))
            assert response.status == 200, await response.text()
            state_response = await client.get("/admin/state", headers=auth("admin"))
            assert state_response.status == 200
            state: dict[str, Any] = await state_response.json()
            metrics = await (await client.get("/metrics")).text()
    # The backend is still shown, its credentials hidden as url.full hides them.
    assert state["backends"]["e0"]["url"] == f"http://REDACTED:REDACTED@{address}"
    assert state["state"]["up"] is False
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for shown, where in ((str(state), "/admin/state"), (metrics, "/metrics"),
                         (logged, "the log")):
        for secret in (*BACKEND_SECRETS, REDIS_SECRET):
            assert secret not in shown, f"{secret} in {where}"


@pytest.mark.parametrize("redis_url", REDIS_URLS)
async def test_the_shared_state_s_log_lines_hide_the_redis_password(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Both lines come on a change (up to down, down to up), which takes a Redis that
    # answers and then stops: driven here through the one method that makes them.
    config = parse_config({"tenants": {"t": {"tier": "standard", "api_keys": ["plain:k"]}},
                           "backends": [{"url": "http://127.0.0.1:1"}],
                           "state": {"backend": "redis", "url": redis_url}})
    shared = SharedState(config.state, SchedulingCore(config))
    caplog.set_level(logging.WARNING, logger="weighbridge.sidecar")
    try:
        shared._mark(True)
        shared._mark(False, "ConnectionError: refused")
    finally:
        await shared.stop()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and "reachable" in lines[0] and "unreachable" in lines[1]
    for line in lines:
        assert REDIS_SECRET not in line
        assert "REDACTED" in line
