"""The exporter over real HTTP: plain threads, a gevent-patched process like Locust's, and
scraping a real emulator's /metrics for the served-token rate."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.support import loopback
from tests.support.metrics import parse
from tests.support.wait import wait_for
from weighbridge.exporters.loadgen import LoadgenExporter
from weighbridge.launch import emulator_process, free_port

REPO = Path(__file__).resolve().parents[3]


def test_serve_and_close() -> None:
    exporter = LoadgenExporter(tiers={"a": "standard"})
    port = free_port()
    exporter.serve(port)
    try:
        exporter.request_started("a", "standard", 300, exporter.clock())
        response = loopback.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert response.status_code == 200
        assert parse(response.text).value("weighbridge_client_in_flight_tokens", tenant="a",
                     tier="standard") == 300
        with pytest.raises(RuntimeError, match="already serving"):
            exporter.serve(free_port())
    finally:
        exporter.close()
    with pytest.raises(httpx.ConnectError):
        loopback.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    exporter.close()  # idempotent


GEVENT_CHILD = textwrap.dedent("""
    import locust  # noqa: F401 - monkey-patches the process exactly as a Locust run does
    import sys

    import gevent
    import httpx
    from gevent import monkey

    from weighbridge.exporters.loadgen import LoadgenExporter

    assert monkey.is_module_patched("threading") and monkey.is_module_patched("socket")
    port = int(sys.argv[1])
    exporter = LoadgenExporter(tiers={"a": "standard"})
    exporter.serve(port)
    exporter.request_started("a", "standard", 42, exporter.clock())
    # A greenlet of the same process scrapes while the server runs as a greenlet too.
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'weighbridge_client_in_flight_tokens{tenant="a",tier="standard"} 42.0' in text
    print("ready", flush=True)
    gevent.sleep(30)  # the parent scrapes from outside meanwhile, then kills us
""")


def test_serves_under_gevent_monkey_patching() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", GEVENT_CHILD, str(port)], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != "ready":
            child.kill()
            _, err = child.communicate(timeout=10)
            pytest.fail(f"gevent child failed: {line!r}\n{err}")
        for _ in range(3):  # several scrapes: the server greenlet keeps answering
            response = loopback.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            assert response.status_code == 200
            assert parse(response.text).value("weighbridge_client_in_flight_requests", tenant="a",
                         tier="standard") == 1
    finally:
        child.kill()
        child.communicate(timeout=10)


def test_backend_scrape_reads_the_emulator_token_counters() -> None:
    with emulator_process(max_num_seqs=8) as engine:
        exporter = LoadgenExporter(backend_metrics_url=f"{engine.url}/metrics",
                                   scrape_interval_s=0.2, window_s=30.0)
        # The baseline scrape, before the request. Each attempt times out after the scrape
        # interval (0.2 s), which a loaded machine can exceed: a failed attempt only counts
        # an error, so wait (bounded) for one that succeeds.
        wait_for(exporter.scrape_backend, timeout_s=10, what="a first backend scrape")
        body = {"model": _model(engine.url), "prompt": [5] * 64, "max_tokens": 32,
                "ignore_eos": True}
        sent = time.monotonic()
        response = loopback.post(f"{engine.url}/v1/completions", json=body, timeout=30)
        post_s = time.monotonic() - sent
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        served = usage["prompt_tokens"] + usage["completion_tokens"]
        exporter.serve(free_port())  # starts the periodic scraper
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = _scrape(exporter)
                try:
                    rate = parse(text).value("weighbridge_served_tokens_per_second",
                                             source="backend")
                except KeyError:
                    rate = 0.0
                if rate > 0:
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"no backend rate after 10 s:\n{text}")
        finally:
            exporter.close()
        # The counters rose by this request's tokens between the first scrape (before the
        # request) and a later one (after it): at most its tokens over the time it took.
        # (Not over the scrape interval: the scraper's first scrape can come sooner.)
        assert 0 < rate <= served / post_s


def test_unreachable_backend_falls_back_to_the_client_view() -> None:
    exporter = LoadgenExporter(backend_metrics_url=f"http://127.0.0.1:{free_port()}/metrics",
                               scrape_interval_s=0.5)
    assert not exporter.scrape_backend()
    assert not exporter.scrape_backend()
    text = _scrape(exporter)
    assert parse(text).value("weighbridge_client_backend_scrape_errors_total") == 2
    assert parse(text).value("weighbridge_served_tokens_per_second", source="client") == 0
    with pytest.raises(ValueError, match="backend_metrics_url"):
        LoadgenExporter().scrape_backend()


def _scrape(exporter: LoadgenExporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()


def _model(url: str) -> str:
    return loopback.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
