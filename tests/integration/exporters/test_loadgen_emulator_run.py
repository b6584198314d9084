"""The exporter fed by real streamed requests against the emulator, scraped over HTTP: on a
steady two-tenant run Little's Law closes at both levels, the token shares are the records'
and the offered load matches the backend's token rate; an exporter that loses every fifth
end of the same traffic departs from 1.

(The Locust load generator wires the same exporter; this test uses the integration driver so
it does not depend on it.)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import httpx
import pytest
from prometheus_client import generate_latest

from tests.support import driver, loopback
from tests.support.metrics import parse
from weighbridge.exporters.loadgen import LoadgenExporter
from weighbridge.launch import emulator_process, free_port
from weighbridge.records import RequestRecord

ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "num_kv_blocks": 1024,
          "max_model_len": 2048}
TENANTS = {"a": (4.0, 2.0), "b": (2.0, 1.0)}  # name: (requests/s, weight)
DURATION_S = 24.0
MID_RUN_S = 18.0
WINDOW_S = 60.0  # the end-of-run scrape covers the whole run, for the share check
PROMPT, MAX_TOKENS = 96, 48


def to_record(out: driver.Outcome, n: int) -> RequestRecord:
    ok = out.ok
    return RequestRecord(
        run_id="r", scenario="steady", phase="main", request_id=f"{out.tenant}-{n}",
        tenant=out.tenant, tier="standard", endpoint="/v1/completions", stream=True,
        max_tokens=MAX_TOKENS, scheduled_s=out.scheduled_s, sent_s=out.scheduled_s,
        first_token_s=out.first_token_s, last_token_s=out.end_s if ok else None,
        end_s=out.end_s if out.end_s is not None else out.scheduled_s,
        prompt_tokens=out.prompt_tokens if ok else None,
        output_tokens=out.output_tokens if ok else None, chunks=out.output_tokens if ok else 0,
        status="ok" if ok else "error", http_status=out.status or None)


@dataclass
class Scrapes:
    mid_honest: str = ""  # over HTTP, while traffic flows
    mid_lossy: str = ""
    end_honest: str = ""  # over HTTP, after the last request ended


def test_steady_emulator_run() -> None:
    scrapes = Scrapes()
    with emulator_process(**ENGINE) as engine:
        model = loopback.get(f"{engine.url}/v1/models", timeout=5).json()["data"][0]["id"]
        weights = {t: w for t, (_, w) in TENANTS.items()}
        tiers = dict.fromkeys(TENANTS, "standard")
        honest = LoadgenExporter(weights=weights, tiers=tiers, window_s=WINDOW_S,
                                 backend_metrics_url=f"{engine.url}/metrics",
                                 scrape_interval_s=1.0)
        lossy = LoadgenExporter(weights=weights, tiers=tiers, window_s=WINDOW_S)
        metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        honest.serve(int(metrics_url.split(":")[2].split("/")[0]))
        try:
            records = asyncio.run(drive(engine.url, model, honest, lossy, metrics_url, scrapes))
            scrapes.end_honest = loopback.get(metrics_url, timeout=5).text
        finally:
            honest.close()

    assert all(r.status == "ok" for r in records), [r for r in records if r.status != "ok"]
    # Mid-run, requests in flight: the honest exporter closes, the lossy one does not.
    # The program level holds nothing here (no agent programs): 0/0.
    ratios = {labels: ratio for labels, ratio
              in parse(scrapes.mid_honest).values("weighbridge_littles_law_ratio").items()
              if ("level", "program") not in labels}
    print("littles_law_ratio mid-run", {tuple(sorted(k)): round(v, 4) for k, v in ratios.items()})
    assert len(ratios) == 4
    for labels, ratio in ratios.items():
        assert 0.9 <= ratio <= 1.1, (labels, ratio)
    lossy_ratios = {labels: ratio for labels, ratio
                    in parse(scrapes.mid_lossy).values("weighbridge_littles_law_ratio").items()
                    if ("level", "program") not in labels}
    print("lossy", {tuple(sorted(k)): round(v, 4) for k, v in lossy_ratios.items()})
    for labels, ratio in lossy_ratios.items():
        assert ratio > 1.1, (labels, ratio)

    # At the end the window holds the whole run: shares are the records'.
    tokens = {t: sum((r.prompt_tokens or 0) + (r.output_tokens or 0) for r in records
                     if r.tenant == t) for t in TENANTS}
    shares = parse(scrapes.end_honest).values("weighbridge_tenant_token_share")
    expected = {t: n / sum(tokens.values()) for t, n in tokens.items()}
    print("token_share", {dict(k)["tenant"]: round(v, 4) for k, v in shares.items()},
          "records", {t: round(v, 4) for t, v in expected.items()})
    for tenant, share in expected.items():
        assert shares[frozenset({("tenant", tenant)})] == pytest.approx(share, abs=0.02)

    served = parse(scrapes.end_honest).values("weighbridge_served_tokens_per_second")
    ratio = parse(scrapes.end_honest).values("weighbridge_offered_token_load_ratio")[frozenset()]
    print("served", {tuple(k): v for k, v in served.items()}, "offered/served", ratio)
    assert frozenset({("source", "backend")}) in served
    assert 0.8 <= ratio <= 1.2


async def drive(url: str, model: str, honest: LoadgenExporter, lossy: LoadgenExporter,
                metrics_url: str, scrapes: Scrapes) -> list[RequestRecord]:
    t0 = time.monotonic()
    body = driver.completion_body(PROMPT, MAX_TOKENS, model)
    records: list[RequestRecord] = []

    async def one(session: aiohttp.ClientSession, tenant: str, scheduled_s: float,
                  n: int) -> None:
        delay = t0 + scheduled_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        for exporter in (honest, lossy):
            exporter.request_started(tenant, "standard", PROMPT + MAX_TOKENS, t0 + scheduled_s)
        out = await driver.streamed_request(session, f"{url}/v1/completions", "k", tenant,
                                            body, scheduled_s, t0)
        record = to_record(out, n)
        records.append(record)
        honest.request_ended(record, honest.clock())
        if n % 5:  # the lossy generator forgets every fifth request
            lossy.request_ended(record, lossy.clock())

    async def scrape_mid_run() -> None:
        await asyncio.sleep(t0 + MID_RUN_S - time.monotonic())
        response = await asyncio.to_thread(httpx.get, metrics_url, timeout=5)
        scrapes.mid_honest = response.text
        scrapes.mid_lossy = generate_latest(lossy.registry).decode()

    async with driver.session() as session:
        tasks = [one(session, tenant, s, n)
                 for i, (tenant, (rate, _)) in enumerate(TENANTS.items())
                 for n, s in enumerate(driver.poisson_times(rate, DURATION_S, seed=i))]
        await asyncio.gather(scrape_mid_run(), *tasks)
    return records
