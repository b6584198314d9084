"""Smoke: every scheduling policy serves requests end to end (stream and whole answers, both
endpoints, two tenants in two tiers), with the sidecar's headers and an exact ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.support.answers import assert_served
from tests.support.ledger import ledger, running, settled
from tests.support.metrics import scrape
from tests.support.stack import auth, completion, start_emulator, start_sidecar, tenant
from tests.support.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def emulator(processes) -> str:
    return start_emulator(processes).url


@pytest.fixture(scope="module", params=["passthrough", "fcfs", "rr", "drr"])
def sidecar(request: pytest.FixtureRequest, processes, emulator: str
            ) -> Iterator[tuple[str, str]]:
    proc = start_sidecar(processes, {
        "tenants": {"a": tenant("interactive", "sk-a", weight=2),
                    "b": tenant("batch", "sk-b")},
        "backends": [{"url": emulator, "priority_scheduling": False}],
        "scheduler": {"policy": request.param},
        "admission": {"max_inflight_per_backend": 2},
    })
    yield request.param, proc.url
    proc.stop()


async def test_policy_serves(sidecar: tuple[str, str], emulator: str) -> None:
    policy, url = sidecar
    before = await asyncio.to_thread(ledger, url)
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        requests = [
            client.post(url + "/v1/completions", json=completion(6, stream=stream),
                        headers=auth(key))
            for key in ("sk-a", "sk-b") for stream in (False, True) for _ in range(2)
        ] + [
            client.post(url + "/v1/chat/completions", json={**chat, "stream": stream},
                        headers=auth(key))
            for key in ("sk-a", "sk-b") for stream in (False, True)
        ]
        responses = await asyncio.gather(*requests)
    for response in responses:
        name = "a" if response.request.headers["authorization"].endswith("sk-a") else "b"
        assert_served(response, name)
        if response.headers["content-type"].startswith("application/json"):
            assert response.json()["usage"]["completion_tokens"] == 6
        else:
            assert response.text.endswith("data: [DONE]\n\n")
    delta = await asyncio.to_thread(settled, url) - before
    assert delta.arrived == delta.completed == len(responses), (policy, delta)
    assert await asyncio.to_thread(running, emulator) == 0
    tokens = (await asyncio.to_thread(scrape, url)).total("weighbridge_tokens_served_total",
                                                          kind="output")
    assert tokens >= 6 * len(responses)


def test_priority_field_is_owned_by_the_sidecar(processes) -> None:
    """The client's ``priority`` orders its own requests; what reaches a backend running
    ``--scheduling-policy priority`` is the tier's ``vllm_priority``, and a backend without
    it gets no ``priority`` at all."""
    with StubBackend() as prio, StubBackend() as plain:
        prio.release()
        plain.release()
        proc = start_sidecar(processes, {
            "tiers": {"interactive": {"rank": 1, "vllm_priority": 1},
                      "batch": {"rank": 3, "vllm_priority": 10}},
            "tenants": {"a": tenant("interactive", "sk-a"), "b": tenant("batch", "sk-b")},
            "backends": [{"url": prio.url, "name": "prio", "priority_scheduling": True},
                         {"url": plain.url, "name": "plain"}],
            "routing": "round_robin",
        })
        with httpx.Client(timeout=30) as client:
            for key, name in (("sk-a", "a"), ("sk-b", "b")):
                for _ in range(2):
                    response = client.post(proc.url + "/v1/completions",
                                           json=completion(3, priority=-5), headers=auth(key))
                    assert_served(response, name)
            # Stepping down a tier takes that tier's priority.
            for _ in range(2):
                response = client.post(proc.url + "/v1/completions",
                                       json=completion(3, priority=-5),
                                       headers={**auth("sk-a"), "x-weighbridge-tier": "batch"})
                assert_served(response, "a")
        proc.stop()
    assert [b["priority"] for b in prio.bodies] == [1, 10, 10]
    assert all("priority" not in b for b in plain.bodies) and len(plain.bodies) == 3
    for body in prio.bodies + plain.bodies:  # everything else passes through as sent
        assert body["prompt"] == [7] * 4 and body["max_tokens"] == 3 and body["ignore_eos"]
