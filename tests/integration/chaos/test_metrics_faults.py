"""A backend whose /metrics misbehaves: it hangs, answers garbage, or answers without the
series admission needs. In every case admission falls back to the in-flight cap
``max_inflight_per_backend``: dispatch neither stops (every request is served once the
backend answers) nor floods (never more than the cap at the backend at once).

A /metrics answering 500, and fresh metrics going stale, are covered by
tests/integration/sidecar/test_backend_faults.py (``test_unreachable_metrics_fall_back_to_the_cap``,
``test_stale_metrics_fall_back_to_the_cap``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.answers import assert_served
from tests.support.chaos import MetricsFaultBackend
from tests.support.ledger import admin_state, ledger, settled
from tests.support.metrics import scrape
from tests.support.stack import ADMIN_KEY, auth, completion, start_sidecar, tenant
from tests.support.wait import await_for

pytestmark = pytest.mark.timeout(90)

KEY = "sk-metrics-faults"
FALLBACK_CAP = 3
POLL_MS = 100

FAULTS = {
    "hang": ("hang", 200, ""),
    "garbage": ("answer", 200, "\x00\xff this is { not prometheus\n" * 50),
    "html": ("answer", 200, "<html><body>502 Bad Gateway</body></html>"),
    # Well-formed exposition without the series admission needs.
    "partial": ("answer", 200, 'vllm:num_requests_running{model_name="m"} 1\n'),
    "negative": ("answer", 200, 'vllm:num_requests_waiting{model_name="m"} -5\n'
                 'vllm:num_requests_running{model_name="m"} NaN\n'
                 'vllm:generation_tokens_total{model_name="m"} +Inf\n'),
    "forbidden": ("answer", 403, "forbidden"),
}


@pytest.fixture(scope="module")
def stub(processes) -> tuple[MetricsFaultBackend, str]:
    backend = processes.enter_context(MetricsFaultBackend())
    sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("batch", KEY)},
        "backends": [{"url": backend.url, "name": "stub"}],
        "admission": {"max_inflight_per_backend": FALLBACK_CAP, "metrics_poll_ms": POLL_MS,
                      "metrics_stale_ms": 3 * POLL_MS},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    return backend, sidecar.url


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_bad_metrics_fall_back_to_the_cap(stub: tuple[MetricsFaultBackend, str],
                                                fault: str) -> None:
    backend, url = stub
    mode, status, text = FAULTS[fault]
    backend.metrics_mode, backend.metrics_status, backend.metrics_text = mode, status, text
    backend.hold()
    backend.max_holding = 0
    try:
        errors_before = (await asyncio.to_thread(admin_state, url))["backends"]["stub"][
            "scrape_errors"]
        # Several polls under the fault: each counted as a failed scrape, none fresh.
        await await_for(lambda: admin_state(url)["backends"]["stub"]["scrape_errors"]
                        >= errors_before + 2, what="failed scrapes")
        before = await asyncio.to_thread(ledger, url)
        total = 3 * FALLBACK_CAP
        async with httpx.AsyncClient(timeout=30) as client:
            tasks = [asyncio.create_task(client.post(
                url + "/v1/completions", json=completion(5), headers=auth(KEY)))
                for _ in range(total)]
            await await_for(lambda: backend.holding == FALLBACK_CAP, what="the cap to fill")
            await await_for(lambda: ledger(url).queued - before.queued == total - FALLBACK_CAP,
                            what="the rest to queue")
            await asyncio.sleep(5 * POLL_MS / 1000)  # polls and ticks later: still the cap
            assert backend.holding == FALLBACK_CAP
            view = (await asyncio.to_thread(admin_state, url))["backends"]["stub"]
            assert view["healthy"] is True  # a bad /metrics is not a dead backend
            assert view["gate"]["fresh"] is False
            assert view["gate"]["reason"] == "fallback_cap"
            metrics = await asyncio.to_thread(scrape, url)
            assert metrics.total("weighbridge_admission_holds_total", backend="stub",
                                 reason="fallback_cap") > 0
            backend.release()
            responses = await asyncio.gather(*tasks)
        for response in responses:
            assert_served(response, "t", "stub")
        assert backend.max_holding == FALLBACK_CAP  # never a flood
        delta = await asyncio.to_thread(settled, url) - before
        assert delta.arrived == delta.completed == total
    finally:
        backend.metrics_mode, backend.metrics_status = "answer", 500
        backend.release()
    health = await asyncio.to_thread(httpx.get, url + "/healthz", timeout=10)
    assert health.status_code == 200
