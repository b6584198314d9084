"""Monthly and daily quotas that hold like contracts (issue 41): a sidecar process killed
with SIGKILL mid-month, with a request in flight, and started again hands out nothing more
of the month; a Redis killed mid-run neither. Real processes on loopback: an emulated
engine, the sidecar, redis-server.

Refill: every limit here is per day or per month, and a test lasts well under a minute: a
rolling month of 12 requests refills 12 / 2,592,000 s, under a thousandth of a request in a
minute, and a day of 400 tokens 400 / 86,400 s, under 0.3 tokens a minute (a request costs
20); so the counts are exact."""

from __future__ import annotations

import contextlib
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.ledger import admin_state, running
from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.stack import ADMIN_KEY, auth, completion, start_emulator, tenant
from tests.support.wait import wait_for
from weighbridge.launch import ServerProcess, sidecar_process

pytestmark = pytest.mark.timeout(120)

MONTH = 12  # requests a month of tenant "monthly"
DAY_TOKENS, TOKENS_PER_REQUEST = 400, 20  # a 4-token prompt and 16 of output, as estimated


@pytest.fixture(scope="module")
def engine(processes: contextlib.ExitStack) -> ServerProcess:
    # 10 ms steps: a 16-token answer takes 0.16 s, a 2,000-token one is in flight for 20 s,
    # long enough to be killed in.
    return start_emulator(processes, t_fixed=0.01)


def config(engine: ServerProcess, **state: Any) -> dict[str, Any]:
    return {
        "tenants": {
            "monthly": tenant("standard", "sk-monthly",
                              limits={"requests_per_month": MONTH}),
            "daily": tenant("standard", "sk-daily",
                            limits={"tokens_per_day": DAY_TOKENS, "windows": "calendar"}),
        },
        "endpoints": {"/v1/completions": {"initial_output_estimate": 16}},
        "backends": [{"url": engine.url}],
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
        "state": state,
    }


@contextlib.contextmanager
def sidecar(engine: ServerProcess, directory: Path, **state: Any) -> Iterator[ServerProcess]:
    """A sidecar whose configuration (and so its quota file) lives in ``directory``."""
    with sidecar_process(config(engine, **state), config_dir=directory) as process:
        yield process


def send(url: str, key: str, n: int) -> dict[int, int]:
    """``n`` requests one after the other; the count of each status."""
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            response = client.post(url + "/v1/completions", json=completion(16),
                                   headers=auth(key))
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code == 429:
                assert response.json()["error"]["code"] == "rate_limited", response.text
    return statuses


def test_a_sidecar_killed_mid_month_hands_out_nothing_more(engine: ServerProcess) -> None:
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-quotas-"))
    with sidecar(engine, directory) as first:
        assert send(first.url, "sk-monthly", 5) == {200: 5}
        assert send(first.url, "sk-daily", 8) == {200: 8}  # 160 of the day's 400 tokens
        # One more of the month, in flight when the process dies: admitted, so spent.
        with httpx.Client(timeout=60) as client, contextlib.suppress(httpx.HTTPError), \
                client.stream("POST", first.url + "/v1/completions",
                              json=completion(2_000, stream=True),
                              headers=auth("sk-monthly")) as stream:
            wait_for(lambda: running(engine.url) >= 1, 10, what="the request in flight")
            first.signal(signal.SIGKILL)
            for _ in stream.iter_bytes():
                pass
    assert (directory / "weighbridge-quotas.sqlite3").exists()
    wait_for(lambda: running(engine.url) == 0, 10, what="the engine to drop the request")
    with sidecar(engine, directory) as second:
        state = admin_state(second.url)["state"]["quota_file"]
        assert state["up"] and state["restored"] >= 2
        # 12 - 5 served - 1 killed in flight: 6 left, not a fresh month.
        assert send(second.url, "sk-monthly", MONTH) == {200: MONTH - 5 - 1, 429: 5 + 1}
        # 400 - 160 = 240 tokens left, not 400; the file was told 1% (4 tokens) ahead of
        # the admissions, which the crash costs: 236, 11 requests of 20.
        left = DAY_TOKENS - 8 * TOKENS_PER_REQUEST - DAY_TOKENS // 100
        assert send(second.url, "sk-daily", 20) == {200: left // TOKENS_PER_REQUEST,
                                                    429: 20 - left // TOKENS_PER_REQUEST}
        second.stop()  # a clean stop writes the levels as they are ...
    with sidecar(engine, directory) as third:
        # ... and they hold again.
        assert send(third.url, "sk-monthly", 2) == {429: 2}
        assert send(third.url, "sk-daily", 2) == {429: 2}
        assert scrape(third.url).value("weighbridge_quota_store_up") == 1


def test_a_quota_file_that_cannot_be_written_is_said_once(engine: ServerProcess) -> None:
    """A file in a directory that cannot be made: the limits hold in memory, and the log,
    the metric and /admin/state say so."""
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-quotas-"))
    (directory / "blocked").write_text("a file where the directory would be")
    with sidecar(engine, directory, quota_file="blocked/quotas.sqlite3") as process:
        assert scrape(process.url).value("weighbridge_quota_store_up") == 0
        assert admin_state(process.url)["state"]["quota_file"]["up"] is False
        assert send(process.url, "sk-monthly", MONTH + 1) == {200: MONTH, 429: 1}
        assert process.log_path is not None
        assert process.log_path.read_text().count("cannot be used") == 1


def test_redis_killed_mid_run_hands_out_nothing_more(engine: ServerProcess) -> None:
    """A month of 12: 4 through Redis, Redis killed: the sidecar goes on from the level it
    last read (8), so 8 more at most, then Redis is back with the level it wrote to disk,
    is told of those 8 before it admits again, and the month stays spent."""
    with RedisServer(persistent=True) as redis_server, \
            sidecar(engine, Path(tempfile.mkdtemp(prefix="weighbridge-quotas-")),
                    backend="redis", url=redis_server.url, timeout_ms=200,
                    sync_ms=50, heartbeat_ms=200) as process:
        assert send(process.url, "sk-monthly", 4) == {200: 4}
        redis_server.kill()
        assert send(process.url, "sk-monthly", 10) == {200: MONTH - 4, 429: 2}
        assert scrape(process.url).value("weighbridge_shared_state_up") == 0
        redis_server.start()
        wait_for(lambda: scrape(process.url).value("weighbridge_shared_state_up") == 1, 10,
                 what="Redis reachable again")
        assert admin_state(process.url)["state"]["owed_buckets"] == 0
        assert send(process.url, "sk-monthly", 4) == {429: 4}
        # The day's calendar tokens through Redis, then Redis killed again, mid-day.
        assert send(process.url, "sk-daily", 5) == {200: 5}  # 100 of 400
        redis_server.kill()
        assert send(process.url, "sk-daily", 20) == {200: 15, 429: 5}
        redis_server.start()
        wait_for(lambda: scrape(process.url).value("weighbridge_shared_state_up") == 1, 10,
                 what="Redis reachable again")
        assert send(process.url, "sk-daily", 3) == {429: 3}
