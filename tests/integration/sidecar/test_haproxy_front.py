"""HAProxy as the replicas' front door (``launch.haproxy_config``, the stack's and the
benchmarks'): a stream's events pass through as the engine writes them. Without
``option http-no-delay`` HAProxy held each small write back (~200 ms here) to fill packets,
which cost the first token 128 ms at p50 at 200 streams/s (benchmarks/sidecar_overhead.py,
2026-12-02).

The engine takes ``STEP_S`` per step, one event per step. The first content event's delay
through the front is compared with the same request's straight to the engine; the minimum of
a few requests each, so a moment's contention on a shared machine does not decide, while a
front that holds events back does so every time."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import pytest

from tests.support import loopback
from tests.support.stack import start_emulator
from weighbridge.launch import haproxy_process

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.3  # the engine's time per step: one generated token per step
TOKENS = 3
REQUESTS = 3
HELD_BACK_S = 0.2  # how long HAProxy held an event back without the option (measured)


@pytest.fixture(scope="module")
def urls(processes: contextlib.ExitStack,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the engine's URL, HAProxy's in front of it)."""
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed (.ci/run installs Debian's package)")
    engine = start_emulator(processes, t_fixed=STEP_S, t_prefill_token=0.0,
                            t_decode_seq=0.0, t_kv_token=0.0)
    directory = Path(tmp_path_factory.mktemp("haproxy"))
    proxy = processes.enter_context(haproxy_process([engine.url], directory,
                                                    health_path="/health"))
    return engine.url, proxy.url


def _first_event_s(url: str) -> float:
    """Seconds from sending a streamed completion to its first content event."""
    body = {"prompt": [11, 12, 13, 14], "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True}
    start = time.monotonic()
    first: float | None = None
    with loopback.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
    assert first is not None
    return first


def test_events_pass_through_the_front_as_the_engine_writes_them(
        urls: tuple[str, str]) -> None:
    engine, front = urls
    direct = min(_first_event_s(engine) for _ in range(REQUESTS))
    proxied = min(_first_event_s(front) for _ in range(REQUESTS))
    # The hop itself costs a millisecond or so; a front holding the event back, ~200 ms.
    assert proxied - direct < HELD_BACK_S / 2, (direct, proxied)
