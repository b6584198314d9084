"""Backends that fail: one killed (SIGKILL) under load, then restarted on the same port;
and one whose /metrics cannot be read.

A killed backend ends each client stream it was serving with an error event and
``[DONE]``, answers its non-streaming requests with a 502 (nothing had reached the client
yet), is marked unhealthy at once so new requests go to the survivor, and is routed to again
when the health probe sees it back. A backend whose metrics fail is admitted to under the
fallback cap ``max_inflight_per_backend``: never unlimited, never blocked.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import httpx
import pytest

from tests.support import loopback
from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import admin_state, ledger, running, settled
from tests.support.metrics import scrape
from tests.support.raw_client import RawClient
from tests.support.stack import ADMIN_KEY, SMALL_ENGINE, auth, completion, start_sidecar, tenant
from tests.support.stub_backend import StubBackend
from tests.support.wait import await_for, wait_for
from weighbridge.launch import ServerProcess, emulator_process, free_port

pytestmark = pytest.mark.timeout(60)

KEY = "sk-faults"
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 8, "t_fixed": 0.02}  # 50 tokens/s per sequence


@dataclass
class Fleet:
    sidecar: str
    ports: dict[str, int]
    emulators: dict[str, ServerProcess]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> ServerProcess:
        proc = emulator_process(name=f"emulator-{name}", port=self.ports[name], **ENGINE)
        self.emulators[name] = proc.start()
        return proc


@pytest.fixture(scope="module")
def fleet(processes) -> Fleet:
    ports = {"a": free_port(), "b": free_port()}
    fleet = Fleet("", ports, {})
    for name in ports:
        fleet.start(name)
    processes.callback(lambda: [p.stop() for p in fleet.emulators.values()])
    sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("standard", KEY)},
        "backends": [{"url": fleet.url(name), "name": name} for name in ports],
        "routing": "round_robin",  # alternates strictly: both backends get traffic
        "health_probe": {"interval_ms": 200, "timeout_ms": 2000},
        # Only the in-flight cap gates dispatch, so routing alternates even on a busy box.
        "admission": {"min_decode_tokens_per_s": 0, "max_backend_waiting": 100},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    fleet.sidecar = sidecar.url
    return fleet


def healthy(fleet: Fleet, name: str) -> float:
    return scrape(fleet.sidecar).total("weighbridge_backend_healthy", backend=name)


async def stream(fleet: Fleet, tokens: int) -> RawClient:
    client = await RawClient.send(fleet.sidecar, "/v1/completions",
                                  completion(tokens, stream=True), auth(KEY))
    assert (await client.read_head()).status == 200
    await client.read_until(b"data: {")
    return client


def backends_of(responses: list[httpx.Response]) -> list[str]:
    return sorted(r.headers["x-weighbridge-backend"] for r in responses)


async def test_backend_killed_mid_stream(fleet: Fleet) -> None:
    await await_for(lambda: healthy(fleet, "a") == healthy(fleet, "b") == 1)
    before = await asyncio.to_thread(ledger, fleet.sidecar)
    # Four streams, then four whole answers, all running: round robin puts two of each on
    # each backend. 200 tokens at 50 tokens/s: they run for 4 s.
    streams = [await stream(fleet, 200) for _ in range(4)]
    streams_on_a = sum(s.response.headers["x-weighbridge-backend"] == "a" for s in streams)
    assert streams_on_a == 2
    async with httpx.AsyncClient(timeout=30) as client:
        whole = [asyncio.create_task(client.post(
            fleet.sidecar + "/v1/completions", json=completion(200), headers=auth(KEY)))
            for _ in range(4)]
        await await_for(lambda: ledger(fleet.sidecar).dispatched - before.dispatched == 8,
                        what="eight requests in flight")
        await await_for(lambda: running(fleet.url("a")) + running(fleet.url("b")) == 8,
                        what="all eight running")
        whole_on_a = await asyncio.to_thread(running, fleet.url("a")) - streams_on_a
        assert whole_on_a >= 1

        fleet.emulators["a"].signal(signal.SIGKILL)

        for s in streams:
            body = await s.read_all(timeout_s=15)
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            if s.response.headers["x-weighbridge-backend"] == "a":
                assert events[-2].startswith(b'data: {"error":'), events[-3:]
            else:  # the survivor's streams run to their end
                assert b'"error"' not in body
                assert b'"finish_reason":"length"' in events[-2], events[-2]
            s.close()
        responses = await asyncio.gather(*whole)
    failed = [r for r in responses if r.status_code != 200]
    served = [r for r in responses if r.status_code == 200]
    assert len(failed) == whole_on_a, [r.status_code for r in responses]
    for r in failed:
        error = assert_rejected(r, 502, "backend_failed")
        assert error["type"] == "server_error"
        assert r.headers["x-weighbridge-backend"] == "a"
    for r in served:
        assert_served(r, "t", "b")
        assert r.json()["usage"]["completion_tokens"] == 200

    assert await asyncio.to_thread(healthy, fleet, "a") == 0
    delta = await asyncio.to_thread(settled, fleet.sidecar) - before
    assert delta.arrived == 8 and delta.failed == 4 and delta.completed == 4
    state = await asyncio.to_thread(admin_state, fleet.sidecar)
    assert state["backends"]["a"]["healthy"] is False
    assert state["backends"]["a"]["inflight"] == 0  # failed requests released their slots

    # New requests go to the survivor only, and all succeed.
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(*(client.post(
            fleet.sidecar + "/v1/completions", json=completion(5), headers=auth(KEY))
            for _ in range(4)))
    for r in responses:
        assert_served(r, "t", "b")
    assert await asyncio.to_thread(running, fleet.url("b")) == 0


def test_readyz_while_one_backend_is_down(fleet: Fleet) -> None:
    if fleet.emulators["a"].is_running():  # run alone, not after the mid-stream kill
        fleet.emulators["a"].signal(signal.SIGKILL)
    wait_for(lambda: not healthy(fleet, "a"), what="a to be marked unhealthy")
    response = loopback.get(fleet.sidecar + "/readyz", timeout=10)
    assert response.status_code == 200  # one healthy backend is enough


def test_restarted_backend_is_probed_back(fleet: Fleet) -> None:
    if fleet.emulators["a"].is_running():
        fleet.emulators["a"].signal(signal.SIGKILL)
        wait_for(lambda: not healthy(fleet, "a"), what="a to be marked unhealthy")
    fleet.emulators["a"].stop()
    fleet.start("a")  # the same port
    wait_for(lambda: healthy(fleet, "a") == 1, timeout_s=5, what="the probe to bring a back")
    with httpx.Client(timeout=30) as client:
        responses = [client.post(fleet.sidecar + "/v1/completions", json=completion(3),
                                 headers=auth(KEY)) for _ in range(4)]
    for r in responses:
        assert_served(r, "t")
    assert backends_of(responses) == ["a", "a", "b", "b"]
    settled(fleet.sidecar)


async def test_all_backends_down_then_back(fleet: Fleet) -> None:
    """With no healthy backend the sidecar is not ready and holds requests in the queue: a
    client that gives up is counted cancelled, one that waits is served when a backend
    returns."""
    before = await asyncio.to_thread(ledger, fleet.sidecar)
    for name in ("a", "b"):
        fleet.emulators[name].signal(signal.SIGKILL)
    await await_for(lambda: healthy(fleet, "a") == healthy(fleet, "b") == 0,
                    what="both backends to be marked unhealthy")
    response = await asyncio.to_thread(httpx.get, fleet.sidecar + "/readyz", timeout=10)
    assert response.status_code == 503 and response.json() == {"ready": False}
    async with httpx.AsyncClient(timeout=30) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(fleet.sidecar + "/v1/completions", json=completion(3),
                              headers=auth(KEY), timeout=0.5)
        waiting = asyncio.create_task(client.post(
            fleet.sidecar + "/v1/completions", json=completion(3), headers=auth(KEY)))
        await await_for(lambda: ledger(fleet.sidecar).queued == 1, what="one queued")
        holds = await asyncio.to_thread(scrape, fleet.sidecar)
        assert holds.total("weighbridge_admission_holds_total", backend="none",
                           reason="no_healthy_backend") > 0
        for name in ("a", "b"):
            await asyncio.to_thread(fleet.emulators[name].stop)
            await asyncio.to_thread(fleet.start, name)
        assert_served(await waiting, "t")
    await await_for(lambda: healthy(fleet, "a") == healthy(fleet, "b") == 1,
                    what="both backends to come back")
    delta = await asyncio.to_thread(settled, fleet.sidecar) - before
    assert delta.arrived == 2 and delta.completed == 1 and delta.cancelled == 1


@pytest.fixture(scope="module")
def quiet_fleet(processes) -> Fleet:
    """Two backends probed only once a minute, so a dead one is found by a request."""
    ports = {"x": free_port(), "y": free_port()}
    fleet = Fleet("", ports, {})
    for name in ports:
        fleet.start(name)
    processes.callback(lambda: [p.stop() for p in fleet.emulators.values()])
    fleet.sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("standard", KEY)},
        "backends": [{"url": fleet.url(name), "name": name} for name in ports],
        "routing": "round_robin",
        "health_probe": {"interval_ms": 60000},
    }).url
    return fleet


def test_request_to_an_unreachable_backend_is_retried_elsewhere(quiet_fleet: Fleet) -> None:
    """A connection the dead backend refuses never delivered the request: it goes back to
    the queue and is served by the other backend; the dead one is marked unhealthy."""
    fleet = quiet_fleet
    before = ledger(fleet.sidecar)
    fleet.emulators["x"].signal(signal.SIGKILL)
    assert healthy(fleet, "x") == 1  # nobody has noticed yet
    with httpx.Client(timeout=30) as client:
        responses = [client.post(fleet.sidecar + "/v1/completions", json=completion(3),
                                 headers=auth(KEY)) for _ in range(4)]
    for r in responses:
        assert_served(r, "t", "y")
    assert healthy(fleet, "x") == 0
    delta = settled(fleet.sidecar) - before
    assert delta.arrived == delta.completed == 4 and delta.failed == 0


# ----------------------------------------------------------------------------- metrics


FALLBACK_CAP = 3


@pytest.fixture(scope="module")
def stub(processes) -> tuple[StubBackend, str]:
    backend = processes.enter_context(StubBackend())
    sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("standard", KEY)},
        "backends": [{"url": backend.url, "name": "stub"}],
        "admission": {"max_inflight_per_backend": FALLBACK_CAP, "metrics_poll_ms": 100,
                      "metrics_stale_ms": 300},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    return backend, sidecar.url


async def test_unreachable_metrics_fall_back_to_the_cap(stub: tuple[StubBackend, str]) -> None:
    """The stub's /metrics answers 500 and it holds every request until released: the
    sidecar dispatches exactly the fallback cap and queues the rest (never unlimited), and
    every request is served once the backend answers (never blocked)."""
    backend, url = stub
    before = await asyncio.to_thread(ledger, url)
    total = 2 * FALLBACK_CAP + 1
    async with httpx.AsyncClient(timeout=30) as client:
        tasks = [asyncio.create_task(client.post(
            url + "/v1/completions", json=completion(5), headers=auth(KEY)))
            for _ in range(total)]
        await await_for(lambda: backend.holding == FALLBACK_CAP, what="the cap to fill")
        await await_for(lambda: ledger(url).queued - before.queued == total - FALLBACK_CAP,
                        what="the rest to queue")
        await asyncio.sleep(0.5)  # several polls and ticks later: still at the cap
        assert backend.holding == FALLBACK_CAP
        metrics = await asyncio.to_thread(scrape, url)
        assert metrics.total("weighbridge_backend_inflight_cap", backend="stub") == FALLBACK_CAP
        assert metrics.total("weighbridge_admission_holds_total", backend="stub",
                             reason="fallback_cap") > 0
        assert not metrics.has("weighbridge_backend_metrics_age_seconds", backend="stub")
        state = await asyncio.to_thread(admin_state, url)
        view = state["backends"]["stub"]
        assert view["healthy"] is True and view["scrape_errors"] > 0
        assert view["gate"]["fresh"] is False and view["gate"]["reason"] == "fallback_cap"
        backend.release()
        responses = await asyncio.gather(*tasks)
    for response in responses:
        assert_served(response, "t", "stub")
        assert response.json()["usage"]["completion_tokens"] == 5
    assert backend.max_holding == FALLBACK_CAP
    delta = await asyncio.to_thread(settled, url) - before
    assert delta.arrived == delta.completed == total


async def test_stale_metrics_fall_back_to_the_cap(stub: tuple[StubBackend, str]) -> None:
    """Fresh metrics that say the backend is swamped (50 waiting) hold dispatch at one
    request; when the scrapes start failing, the sample goes stale after metrics_stale_ms
    and the fallback cap applies: the held requests flow again, up to the cap."""
    backend, url = stub
    backend.hold()
    backend.max_holding = 0
    backend.metrics_text = (
        'vllm:num_requests_waiting{model_name="stub"} 50\n'
        'vllm:num_requests_running{model_name="stub"} 1\n'
        'vllm:generation_tokens_total{model_name="stub"} 100\n'
        'vllm:kv_cache_usage_perc{model_name="stub"} 0.5\n')
    backend.metrics_status = 200
    try:
        await await_for(lambda: admin_state(url)["backends"]["stub"]["gate"]["fresh"],
                        what="fresh metrics")
        before = await asyncio.to_thread(ledger, url)
        total = FALLBACK_CAP + 2
        async with httpx.AsyncClient(timeout=30) as client:
            tasks = [asyncio.create_task(client.post(
                url + "/v1/completions", json=completion(5), headers=auth(KEY)))
                for _ in range(total)]
            # Nothing of ours in flight: one goes regardless; then the gate closes.
            await await_for(lambda: ledger(url).queued - before.queued == total - 1,
                            what="all but one to queue")
            await asyncio.sleep(0.3)
            assert backend.holding == 1
            gate = (await asyncio.to_thread(admin_state, url))["backends"]["stub"]["gate"]
            assert gate["verdict"] == "closed" and gate["reason"] == "backend_waiting"

            backend.metrics_status = 500
            await await_for(lambda: backend.holding == FALLBACK_CAP, timeout_s=5,
                            what="the fallback cap after the metrics went stale")
            await asyncio.sleep(0.3)
            assert backend.holding == FALLBACK_CAP  # never more
            backend.release()
            responses = await asyncio.gather(*tasks)
        for response in responses:
            assert_served(response, "t", "stub")
        assert backend.max_holding == FALLBACK_CAP
        delta = await asyncio.to_thread(settled, url) - before
        assert delta.arrived == delta.completed == total
    finally:
        backend.metrics_status = 500
        backend.release()
