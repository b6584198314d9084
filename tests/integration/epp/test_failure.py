"""The picker killed under Envoy (docs/deploy-kubernetes.md, "When the picker fails"):
every client's request ends once, with its answer or a clear error, and none hangs; then new
requests are refused (fail-closed, the full-duplex default: Envoy ignores
``failure_mode_allow`` there) or go round robin to the pool (fail-open: buffered bodies,
``failure_mode_allow`` and a fallback route without the destination header)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import httpx
import pytest

from tests.support.answers import assert_rejected
from tests.support.ledger import ledger, running
from tests.support.stack import auth, completion, start_emulator, tenant
from tests.support.wait import await_for, wait_for
from weighbridge.launch import (
    EnvoyModes,
    ServerProcess,
    envoy_config,
    envoy_process,
    epp_process,
    free_port,
)

pytestmark = pytest.mark.timeout(120)

KEY = "sk-t"
# Long enough to be mid-stream when the picker dies: 200 tokens at 100 tokens/s.
STREAM = completion(200, stream=True)


def gateway(processes: contextlib.ExitStack, modes: EnvoyModes, fallback: bool
            ) -> tuple[str, ServerProcess, list[str]]:
    engines = [start_emulator(processes, t_fixed=0.01) for _ in range(2)]
    picker, grpc_port = epp_process({
        "tenants": {"t": tenant("standard", KEY)},
        "backends": [{"url": e.url} for e in engines],
        "admission": {"max_inflight_per_backend": 2},
    })
    processes.enter_context(picker)
    port, admin = free_port(), free_port()
    endpoints = [("127.0.0.1", int(e.url.rpartition(":")[2])) for e in engines]
    envoy = processes.enter_context(envoy_process(
        envoy_config(port, admin, [("127.0.0.1", grpc_port)], modes,
                     fallback=endpoints if fallback else ()), port, admin))
    return envoy.url, picker, [e.url for e in engines]


async def kill_mid_run(url: str, picker: ServerProcess) -> list[int | str]:
    """Four streams bound (two an engine) and two queued in the picker, then SIGKILL: each
    request's end, its status or the client's error."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def one() -> int | str:
            try:
                async with client.stream("POST", url + "/v1/completions", json=STREAM,
                                         headers=auth(KEY)) as response:
                    async for _ in response.aiter_bytes():
                        pass
                    return response.status_code
            except httpx.HTTPError as e:  # a stream cut off mid-body: a clear error
                return type(e).__name__

        requests = [asyncio.ensure_future(one()) for _ in range(6)]
        await await_for(lambda: ledger(picker.url).queued == 2, timeout_s=30,
                        what="four bound, two queued")
        picker.signal(signal.SIGKILL)
        # The client's own timeout (60 s) is the bound: a request that hangs fails the test.
        ends = list(await asyncio.gather(*requests))
        return ends


async def test_killed_picker_fails_closed_in_full_duplex(processes: contextlib.ExitStack
                                                         ) -> None:
    url, picker, engines = gateway(processes, EnvoyModes(), fallback=False)
    ends = await kill_mid_run(url, picker)
    # The two queued in the picker get Envoy's 500; the four streams are cut off mid-body
    # (the client's protocol error: an incomplete chunked body), or finished if they could.
    assert len(ends) == 6 and ends.count(500) == 2, ends
    assert all(end in (500, 200, "RemoteProtocolError", "ReadError") for end in ends), ends
    response = httpx.post(url + "/v1/completions", json=completion(2), headers=auth(KEY),
                          timeout=30)
    assert response.status_code == 500  # fail-closed: Envoy's answer with no picker
    for engine in engines:  # the engines' sequences end with their streams
        wait_for(lambda e=engine: running(e) == 0, 30, what="the engines idle")


async def test_killed_picker_fails_open_when_buffered(processes: contextlib.ExitStack
                                                      ) -> None:
    modes = EnvoyModes(request_body="BUFFERED", response_body="NONE", failure_mode_allow=True)
    url, picker, engines = gateway(processes, modes, fallback=True)
    ends = await kill_mid_run(url, picker)
    # The response body never passed the picker: the streams finish; the two queued in it
    # go on without a binding, to the fallback route.
    assert ends == [200] * 6, ends
    response = httpx.post(url + "/v1/completions", json=completion(2), headers=auth(KEY),
                          timeout=30)
    assert response.status_code == 200  # fail-open: round robin over the pool
    assert "x-weighbridge-backend" not in response.headers  # no picker bound it
    for engine in engines:
        wait_for(lambda e=engine: running(e) == 0, 30, what="the engines idle")


def test_a_dead_endpoint_is_left_after_envoy_cannot_reach_it(processes: contextlib.ExitStack
                                                             ) -> None:
    """An engine killed between two health probes: Envoy cannot reach the endpoint the
    picker bound (its retries go to the same ip:port, the only one the header names) and
    answers 503 itself; the picker answers the client's 502 in the sidecar's words, marks that
    backend failed, and the requests after it go to the engine alive."""
    engines = [start_emulator(processes) for _ in range(2)]
    picker, grpc_port = epp_process({
        "tenants": {"t": tenant("standard", KEY)},
        "backends": [{"url": e.url} for e in engines],
        # Probes far apart: the picker learns of the death from Envoy's answer, not a probe.
        "health_probe": {"interval_ms": 60_000},
    })
    processes.enter_context(picker)
    port, admin = free_port(), free_port()
    envoy = processes.enter_context(envoy_process(
        envoy_config(port, admin, [("127.0.0.1", grpc_port)]), port, admin))
    engines[0].signal(signal.SIGKILL)
    dead = engines[0].url.removeprefix("http://")
    statuses = []
    with httpx.Client(timeout=30) as client:
        for _ in range(6):
            response = client.post(envoy.url + "/v1/completions", json=completion(2),
                                   headers=auth(KEY))
            statuses.append((response.status_code,
                             response.headers.get("x-weighbridge-backend")))
            if response.status_code != 200:  # the sidecar's answer, not Envoy's text
                assert_rejected(response, 502, "backend_unavailable")
    failed = [s for s in statuses if s[0] != 200]
    # At most the one request bound before the picker knew; every other is served alive.
    assert len(failed) <= 1 and all(backend == dead for _, backend in failed), statuses
    assert all(backend != dead for status, backend in statuses if status == 200), statuses
    assert ledger(picker.url).failed == len(failed)
    assert picker.log_path is not None and "Traceback" not in picker.log_path.read_text()
