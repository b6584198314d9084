"""Reloading a running sidecar's configuration under steady streaming load (issue 31's
acceptance): tenants added and removed, a key rotated, limits raised and lowered, a weight
changed, a backend added and one drained, and invalid configs refused, first through one
sidecar, then through three replicas sharing Redis, reloaded one at a time. No client sees
an error but the intended ones, every stream completes byte for byte, and the ledger
balances across every reload."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml

from tests.support.driver import Outcome, completion_body, session, streamed_request
from tests.support.ledger import Ledger, admin_state, backend_finished, ledger, settled
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import (
    ADMIN_KEY,
    auth,
    completion,
    start_emulator,
    start_sidecar,
    tenant,
)
from tests.support.wait import await_for
from weighbridge.emulator.text import generated_text
from weighbridge.launch import ServerProcess, free_port, weighbridge_argv
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.reload import config_version
from weighbridge.sidecar.shared import bucket_key

pytestmark = pytest.mark.timeout(300)

MODEL = "weighbridge-emulator"
PROMPT, OUTPUT = 16, 24
CLIENTS = 6  # closed-loop clients per loaded tenant
# Tenant d's limit, lowered below what it has spent and raised again; each of its requests
# costs exactly 20 tokens (a 4-token prompt, 16 of output, which the estimate also says).
D_LIMIT, D_LOWERED, D_COST = 10_000, 70, 20
# c's requests queued for a model no backend that takes work serves, per replica.
HELD, HELD_MODEL = 3, "held-model"


@dataclass
class Site:
    """One sidecar process and the config file it reloads."""

    process: ServerProcess

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def path(self) -> Path:
        argv = list(self.process.argv)
        return Path(argv[argv.index("--config") + 1])

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid


def version(data: dict[str, Any]) -> str:
    return config_version(parse_config(data))


async def reload_each(sites: list[Site], data: dict[str, Any], how: str = "http") -> None:
    """Write ``data`` to each replica's file and reload it, one replica at a time, each
    confirmed (its version) before the next: ``how`` is ``http`` (POST /admin/reload),
    ``cli`` (``weighbridge reload``, the key from the file) or ``signal`` (SIGHUP, through
    ``weighbridge reload --pid``)."""
    want = version(data)
    async with httpx.AsyncClient(timeout=10) as client:
        for site in sites:
            site.path.write_text(yaml.safe_dump(data, sort_keys=False))
            if how == "http":
                response = await client.post(site.url + "/admin/reload", headers=auth(ADMIN_KEY))
                assert response.status_code == 200, response.text
                assert response.json()["version"] == want
            elif how == "cli":
                done = await asyncio.to_thread(
                    subprocess.run, weighbridge_argv("reload", "--url", site.url, "--config",
                                                     str(site.path)),
                    capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
                assert done.stdout.startswith(f"version {want} in force"), done.stdout
            else:
                done = await asyncio.to_thread(
                    subprocess.run, weighbridge_argv("reload", "--pid", str(site.pid)),
                    capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
                await await_for(lambda s=site: admin_state(s.url)["config"]["version"] == want,
                                20, what="the SIGHUP reload")


@dataclass
class Load:
    """Closed-loop streaming clients per tenant, spread over the replicas; each request
    ends before the client's next is sent. A client whose key is refused stops."""

    urls: list[str]
    http: aiohttp.ClientSession
    keys: dict[str, str]
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def start(self, name: str) -> None:
        self.outcomes.setdefault(name, [])
        self.tasks += [asyncio.create_task(self._client(name, i)) for i in range(CLIENTS)]

    async def _client(self, name: str, i: int) -> None:
        body = completion_body(PROMPT, OUTPUT, MODEL)
        url = self.urls[i % len(self.urls)] + "/v1/completions"
        while not self.stopping.is_set():
            out = await streamed_request(self.http, url, self.keys[name], name, body,
                                         time.monotonic() - self.t0, self.t0)
            self.outcomes[name].append(out)
            if out.status == 401:
                return
            if not out.ok:
                await asyncio.sleep(0.05)  # a refused request's backoff, as a client's

    def completed(self, name: str) -> int:
        return sum(o.ok for o in self.outcomes.get(name, ()))

    async def stop(self) -> None:
        """Every client ends after its request in flight: nothing is cut."""
        self.stopping.set()
        await asyncio.gather(*self.tasks)

    async def cancel(self) -> None:
        """A failed test's way out: the clients are cut."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def initial_config(engines: list[str], redis_url: str | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "tenants": {
            "a": tenant("standard", "ka-1"),
            "b": tenant("standard", "kb", limits={"tokens_per_minute": 10_000_000}),
            "d": tenant("standard", "kd", limits={"tokens_per_month": D_LIMIT}),
        },
        "endpoints": {"/v1/completions": {"initial_output_estimate": 16}},
        "backends": [{"url": url, "name": f"e{i}"} for i, url in enumerate(engines[:2])],
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
        # Few slots, so the queues always hold requests (a removed tenant has some queued).
        "admission": {"max_inflight_per_backend": 2},
        # The batch tier still gets a quarter of the dispatches while standard is backlogged.
        "scheduler": {"anti_starvation_weight": 0.25},
        "health_probe": {"interval_ms": 200},
    }
    if redis_url is not None:
        # The buckets are asserted exactly: Redis must never be judged down (each replica
        # then falls back to its own share of the limits), and 1 s is far beyond the
        # slowest answer of a local Redis on a loaded machine.
        data["state"] = {"backend": "redis", "url": redis_url, "timeout_ms": 1000}
    return data


def d_bucket(sites: list[Site], redis_server: RedisServer | None) -> tuple[float, float]:
    """(capacity, level) of tenant d's month bucket: Redis's when shared, else the
    sidecar's own."""
    if redis_server is None:
        bucket = admin_state(sites[0].url)["rate_limits"]["tenants"]["d"]["tokens_per_month"]
        return bucket["capacity"], bucket["level"]
    stored = redis_server.client().hgetall(
        bucket_key("weighbridge", ("tenant", "d"), "tokens_per_month"))
    return float(stored["cap"]), float(stored["level"])


def d_request(site: Site) -> httpx.Response:
    return httpx.post(site.url + "/v1/completions", json=completion(16, prompt_tokens=4),
                      headers=auth("kd"), timeout=30)


async def run_scenario(sites: list[Site], engines: list[str],
                       redis_server: RedisServer | None) -> None:
    data = initial_config(engines, None if redis_server is None else redis_server.url)
    await reload_each(sites, data)
    before = [ledger(s.url) for s in sites]
    finished_before = [backend_finished(e) for e in engines]
    probes: Counter[str] = Counter()  # the intended refusals the test sends itself
    async with session() as http, contextlib.AsyncExitStack() as cleanup:
        load = Load([s.url for s in sites], http, {"a": "ka-1", "b": "kb", "c": "kc"})
        cleanup.push_async_callback(load.cancel)
        load.start("a")
        load.start("b")
        await await_for(lambda: load.completed("a") and load.completed("b"), 30,
                        what="the load to stream")

        # A tenant added: served from its first request.
        data = copy.deepcopy(data)
        data["tenants"]["c"] = tenant("batch", "kc")
        await reload_each(sites, data, "signal")
        load.start("c")
        await await_for(lambda: load.completed("c") >= 3, 30, what="c to be served")

        # A weight changed: in force from the next decision.
        data["tenants"]["b"]["weight"] = 3.0
        await reload_each(sites, data, "cli")
        for site in sites:
            weight = scrape(site.url).value("weighbridge_drr_weight", tenant="b", tier="standard")
            assert weight == 3.0

        # A key rotated, as an operator does it: the new key added, the clients moved to
        # it, the old one removed; the old key is refused at once, open streams finish.
        data["tenants"]["a"]["api_keys"] = ["plain:ka-1", "plain:ka-2"]
        await reload_each(sites, data)
        load.keys["a"] = "ka-2"
        data["tenants"]["a"]["api_keys"] = ["plain:ka-2"]
        await reload_each(sites, data)
        for site in sites:
            refused = await asyncio.to_thread(
                httpx.post, site.url + "/v1/completions", json=completion(4),
                headers=auth("ka-1"), timeout=10)
            assert refused.status_code == 401, refused.text
            probes["unauthorized"] += 1

        # A limit lowered below what was spent, and raised again: the spent tokens stay
        # spent across both (a bucket reset to full would have admitted the 4th request).
        for i in range(3):
            ok = await asyncio.to_thread(d_request, sites[i % len(sites)])
            assert ok.status_code == 200, ok.text
        data["tenants"]["d"]["limits"] = {"tokens_per_month": D_LOWERED}
        data["tenants"]["b"]["limits"] = {"tokens_per_minute": 20_000_000}  # raised under load
        await reload_each(sites, data)
        refused = await asyncio.to_thread(d_request, sites[-1])
        assert refused.status_code == 429, refused.text
        assert refused.headers["x-weighbridge-reject-reason"] == "rate_limited"
        probes["rate_limited"] += 1
        data["tenants"]["d"]["limits"] = {"tokens_per_month": D_LIMIT}
        data["tenants"]["b"]["limits"] = {"tokens_per_minute": 10_000_000}  # lowered
        await reload_each(sites, data)
        ok = await asyncio.to_thread(d_request, sites[0])
        assert ok.status_code == 200, ok.text
        capacity, level = await asyncio.to_thread(d_bucket, sites, redis_server)
        # Four requests' tokens spent, less what the bucket refilled: the test lasts under
        # its 300 s timeout, in which a month bucket of 10,000 refills 1.2 tokens.
        assert capacity == D_LIMIT
        assert 4 * D_COST - 1.2 <= capacity - level <= 4 * D_COST

        # A backend added: probed and scraped first, then it takes work.
        data["backends"].append({"url": engines[2], "name": "e2"})
        await reload_each(sites, data, "signal")
        await await_for(lambda: backend_finished(engines[2]) > finished_before[2], 30,
                        what="the added backend to serve")
        for site in sites:
            assert admin_state(site.url)["backends"]["e2"]["last_scrape"] is not None

        # A backend drained: no new work, its streams finish, then it is forgotten.
        data["backends"] = [b for b in data["backends"] if b["name"] != "e1"]
        await reload_each(sites, data)
        for site in sites:
            await await_for(lambda s=site: "e1" not in admin_state(s.url)["backends"], 30,
                            what="e1 to drain")
        drained_at = await asyncio.to_thread(backend_finished, engines[1])

        # Invalid configs: refused with their dotted paths; everything stays as it was.
        in_force = [admin_state(s.url)["config"] for s in sites]
        invalid = copy.deepcopy(data)
        invalid["tenants"]["a"]["weight"] = -1
        restart_only = {**copy.deepcopy(data), "routing": "round_robin"}
        async with httpx.AsyncClient(timeout=10) as client:
            for site in sites:
                site.path.write_text(yaml.safe_dump(invalid))
                response = await client.post(site.url + "/admin/reload",
                                             headers=auth(ADMIN_KEY))
                assert response.status_code == 422, response.text
                assert "tenants.a.weight" in response.json()["error"]["message"]
                site.path.write_text(yaml.safe_dump(restart_only))
                response = await client.post(site.url + "/admin/reload",
                                             headers=auth(ADMIN_KEY))
                assert response.status_code == 409, response.text
                assert response.json()["error"]["code"] == "restart_required"
                site.path.write_text(yaml.safe_dump(invalid))
                os.kill(site.pid, signal.SIGHUP)
                await await_for(
                    lambda s=site: admin_state(s.url)["config"]["reloads"]["refused"] == 3
                    + in_force[0]["reloads"]["refused"], 20, what="the SIGHUP refusal")
                denied = await client.post(site.url + "/admin/reload", headers=auth("kb"))
                assert denied.status_code == 403
        for site, was in zip(sites, in_force, strict=True):
            now = admin_state(site.url)["config"]
            assert (now["version"], now["loaded_unix_s"]) == (was["version"],
                                                               was["loaded_unix_s"])
            assert "tenants.a.weight" in now["last_error"]
        served = load.completed("a")
        await await_for(lambda: load.completed("a") > served, 30, what="a served after")

        # A tenant removed while it has requests queued: those are answered 503
        # tenant_removed, its streams finish, its next requests get 401. So that some are
        # certainly queued, c also asks for a model only a backend that never answers
        # serves: that backend never takes work (never scraped nor probed healthy), and
        # those requests wait until the removal answers them.
        data["backends"].append({"url": f"http://127.0.0.1:{free_port()}", "name": "held",
                                 "models": [HELD_MODEL]})
        await reload_each(sites, data)
        async with httpx.AsyncClient(timeout=60) as client:
            held = [asyncio.create_task(client.post(
                site.url + "/v1/completions", json=completion(4, model=HELD_MODEL),
                headers=auth("kc"))) for site in sites for _ in range(HELD)]
            for site in sites:
                await await_for(lambda s=site: scrape(s.url).total(
                    "weighbridge_requests_queued", tenant="c") >= HELD, 30,
                    what="c's held requests to be queued")
            del data["tenants"]["c"]
            await reload_each(sites, data)
            for answer in await asyncio.gather(*held):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "tenant_removed"
        await await_for(lambda: all(t.done() for t in load.tasks[2 * CLIENTS:]), 30,
                        what="c's clients to be refused")
        # The backend that never took work, removed: nothing to drain, forgotten at once.
        data["backends"] = [b for b in data["backends"] if b["name"] != "held"]
        await reload_each(sites, data)
        for site in sites:
            assert "held" not in admin_state(site.url)["backends"]
        await load.stop()

    # What every client saw: only the intended refusals.
    for name in ("a", "b"):
        assert all(o.ok for o in load.outcomes[name]), [
            (o.status, o.reject_reason, o.error) for o in load.outcomes[name] if not o.ok]
    seen_c = Counter((o.status, o.reject_reason) for o in load.outcomes["c"] if not o.ok)
    assert set(seen_c) <= {(503, "tenant_removed"), (401, "unauthorized")}, seen_c
    removed = seen_c[(503, "tenant_removed")] + HELD * len(sites)
    refused_c = seen_c[(401, "unauthorized")]
    assert refused_c == CLIENTS
    # Every stream byte for byte: the emulator's text for some request of its, all of it,
    # its usage, and the stream's end.
    served_total = sum(backend_finished(e) for e in engines)
    texts = {generated_text(seed, 0, OUTPUT) for seed in range(1, int(served_total) + 1)}
    streams = [o for outs in load.outcomes.values() for o in outs if o.ok]
    for o in streams:
        assert o.done and o.output_tokens == OUTPUT and o.prompt_tokens == PROMPT, o
        assert o.text in texts, o.text
    # The drained backend got nothing after it was forgotten.
    assert backend_finished(engines[1]) == drained_at
    # The ledger: every request ended once, as the clients saw it.
    after = [settled(s.url) for s in sites]
    delta = Ledger(0, 0, {}, 0, 0, 0, 0)
    for now_, was_ in zip(after, before, strict=True):
        d = now_ - was_
        delta = Ledger(delta.arrived + d.arrived, delta.completed + d.completed,
                       dict(Counter(delta.rejected) + Counter(d.rejected)),
                       delta.cancelled + d.cancelled, delta.failed + d.failed, 0, 0)
    d_served = 3 + 1
    assert delta.completed == len(streams) + d_served
    assert delta.rejected == {"tenant_removed": removed,
                              "unauthorized": refused_c + probes["unauthorized"],
                              "rate_limited": probes["rate_limited"]}
    assert (delta.cancelled, delta.failed) == (0, 0)
    assert delta.arrived == delta.completed + sum(delta.rejected.values())


@pytest.fixture(scope="module")
def engines(processes: contextlib.ExitStack) -> list[str]:
    # Two in the first config, the third added by a reload.
    return [start_emulator(processes).url for _ in range(3)]


def test_reloads_under_load_through_one_sidecar(processes: contextlib.ExitStack,
                                                engines: list[str]) -> None:
    site = Site(start_sidecar(processes, initial_config(engines, None)))
    asyncio.run(run_scenario([site], engines, None))


def test_reloads_one_replica_at_a_time_over_three_sharing_redis(
        processes: contextlib.ExitStack, engines: list[str]) -> None:
    redis_server = processes.enter_context(RedisServer())
    config = initial_config(engines, redis_server.url)
    sites = [Site(start_sidecar(processes, config)) for _ in range(3)]
    asyncio.run(run_scenario(sites, engines, redis_server))
