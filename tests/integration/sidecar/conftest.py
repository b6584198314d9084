"""Shared helpers for the sidecar's integration tests: real emulator and sidecar processes on
loopback, a scraper for both /metrics endpoints, the ledger balance check, raw-socket
clients (for disconnects the test controls byte by byte) and a stub backend.

Each test module starts its own processes (module-scoped fixtures built from
``processes``), so counters accumulate across the tests of one module: tests compare
*deltas* of the sidecar's ledger, and every check ends with ``settled()``, which also
asserts ``arrived == completed + rejected + cancelled + failed + queued + dispatched``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from weighbridge.launch import ServerProcess, emulator_process, free_port, sidecar_process

# The emulator shape most modules use: few sequences, so that holding the backend busy
# takes one or two requests. t_fixed sets the decode speed: 1 / t_fixed tokens/s per sequence.
SMALL_ENGINE: dict[str, object] = {"max_num_seqs": 4, "max_num_batched_tokens": 512,
                                   "num_kv_blocks": 256, "max_model_len": 2048}
ADMIN_KEY = "sk-admin-test"


def tenant(tier: str, key: str, **extra: object) -> dict[str, object]:
    """A tenant entry for the config mapping (plain keys: tests only)."""
    return {"tier": tier, "api_keys": [f"plain:{key}"], **extra}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(max_tokens: int = 4, *, prompt_tokens: int = 4, stream: bool = False,
               **extra: object) -> dict[str, object]:
    """A /v1/completions body with a token-id prompt, so the sidecar's prompt count is exact,
    and ignore_eos, so the output is exactly max_tokens."""
    return {"prompt": [7] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, **extra}


# ----------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def processes() -> Iterator[contextlib.ExitStack]:
    """An exit stack owning every process a module starts; all are stopped at its end."""
    with contextlib.ExitStack() as stack:
        yield stack


def start_emulator(stack: contextlib.ExitStack, **flags: object) -> ServerProcess:
    return stack.enter_context(emulator_process(**{**SMALL_ENGINE, **flags}))


def start_sidecar(stack: contextlib.ExitStack, config: Mapping[str, object]) -> ServerProcess:
    return stack.enter_context(sidecar_process(config))


# ----------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Scrape:
    """One /metrics exposition: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        return sum(value for got, value in self.samples.get(name, ())
                   if all(got.get(k) == v for k, v in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        return any(all(got.get(k) == v for k, v in labels.items())
                   for got, _ in self.samples.get(name, ()))


def scrape(url: str) -> Scrape:
    response = httpx.get(url.rstrip("/") + "/metrics", timeout=5)
    response.raise_for_status()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Scrape(samples)


@dataclass(frozen=True)
class Ledger:
    """The sidecar's request ledger, summed over tenant and tier labels."""

    arrived: int
    completed: int
    rejected: dict[str, int]
    cancelled: int
    failed: int
    queued: int
    dispatched: int

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def __sub__(self, other: Ledger) -> Ledger:
        reasons = set(self.rejected) | set(other.rejected)
        return Ledger(
            self.arrived - other.arrived, self.completed - other.completed,
            {r: self.rejected.get(r, 0) - other.rejected.get(r, 0) for r in reasons
             if self.rejected.get(r, 0) != other.rejected.get(r, 0)},
            self.cancelled - other.cancelled, self.failed - other.failed,
            self.queued - other.queued, self.dispatched - other.dispatched)


def ledger(url: str, **labels: str) -> Ledger:
    """Read the ledger from /metrics and assert it balances (every request ends once)."""
    s = scrape(url)
    rejected: dict[str, int] = {}
    for got, value in s.samples.get("weighbridge_requests_rejected_total", ()):
        if all(got.get(k) == v for k, v in labels.items()):
            rejected[got["reason"]] = rejected.get(got["reason"], 0) + int(value)
    result = Ledger(
        arrived=int(s.total("weighbridge_requests_arrived_total", **labels)),
        completed=int(s.total("weighbridge_requests_completed_total", **labels)),
        rejected=rejected,
        cancelled=int(s.total("weighbridge_requests_cancelled_total", **labels)),
        failed=int(s.total("weighbridge_requests_failed_total", **labels)),
        queued=int(s.total("weighbridge_requests_queued", **labels)),
        dispatched=int(s.total("weighbridge_requests_dispatched", **labels)),
    )
    ends = (result.completed + result.rejected_total + result.cancelled + result.failed
            + result.queued + result.dispatched)
    assert result.arrived == ends, f"ledger does not balance: {result}"
    return result


def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


async def await_for(predicate: Callable[[], Any], timeout_s: float = 5.0,
                    interval_s: float = 0.05, what: str = "condition") -> Any:
    """``wait_for`` for async tests (the predicate is sync and runs in a thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


def settled(url: str, timeout_s: float = 10.0, **labels: str) -> Ledger:
    """The ledger once nothing is queued or in flight (bounded wait); balanced."""
    return wait_for(lambda: (lambda lg: lg if lg.queued == lg.dispatched == 0 else None)(
        ledger(url, **labels)), timeout_s, what="the sidecar to drain")


def running(emulator_url: str) -> float:
    return scrape(emulator_url).total("vllm:num_requests_running")


def backend_finished(emulator_url: str) -> float:
    """Requests the emulator has finished (completed or aborted)."""
    return scrape(emulator_url).total("vllm:e2e_request_latency_seconds_count")


def admin_state(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/admin/state", headers=auth(ADMIN_KEY), timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def assert_rejected(response: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """An OpenAI error body and the reject-reason header; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["x-weighbridge-reject-reason"] == reason
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    assert error["code"] == reason
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_served(response: httpx.Response, tenant_name: str, backend: str | None = None
                  ) -> None:
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.headers["x-weighbridge-tenant"] == tenant_name
    assert float(response.headers["x-weighbridge-queue-ms"]) >= 0
    if backend is not None:
        assert response.headers["x-weighbridge-backend"] == backend
    else:
        assert response.headers["x-weighbridge-backend"]


# ----------------------------------------------------------------------------- raw clients


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]


@dataclass
class RawClient:
    """One HTTP/1.1 request on its own TCP connection, read by hand; closing the connection
    is the client going away (``close``) or resetting it (``abort``)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    buffered: bytes = b""
    response: RawResponse | None = None
    _chunk_left: int = field(default=0, repr=False)

    @classmethod
    async def send(cls, base_url: str, path: str, body: Mapping[str, object] | bytes,
                   headers: Mapping[str, str]) -> RawClient:
        url = httpx.URL(base_url)
        reader, writer = await asyncio.open_connection(url.host, url.port)
        payload = body if isinstance(body, bytes) else orjson.dumps(body)
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.host}:{url.port}",
                 "Content-Type: application/json", f"Content-Length: {len(payload)}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        return cls(reader, writer)

    async def read_head(self, timeout_s: float = 10.0) -> RawResponse:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout_s)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            if ":" in line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        self.response = RawResponse(int(status_line.split()[1]), headers)
        return self.response

    async def read_until(self, marker: bytes, timeout_s: float = 10.0) -> bytes:
        """Body bytes (chunked framing removed) until ``marker`` has been seen."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.buffered:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{marker!r} not seen; got {self.buffered[-500:]!r}")
            chunk = await asyncio.wait_for(self._read_chunk(), left)
            if chunk is None:
                raise EOFError(f"stream ended before {marker!r}; got {self.buffered[-500:]!r}")
            self.buffered += chunk
        return self.buffered

    async def read_all(self, timeout_s: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"stream did not end; got {self.buffered[-500:]!r}")
            chunk = await asyncio.wait_for(self._read_chunk(), left)
            if chunk is None:
                return self.buffered
            self.buffered += chunk

    async def _read_chunk(self) -> bytes | None:
        """One chunk of a chunked body, or None at its end (or at EOF)."""
        line = await self.reader.readline()
        if not line:
            return None
        size = int(line.strip().split(b";")[0], 16)
        if size == 0:
            await self.reader.readline()
            return None
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()


# ----------------------------------------------------------------------------- stub backend


class StubBackend:
    """A vLLM stand-in served from a thread: /health answers 200, /metrics answers
    ``metrics_status`` with ``metrics_text`` (500 by default: unreachable metrics), and
    /v1/completions holds each request until the test calls ``release()``, counting how many
    it holds at once."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_status = 500
        self.metrics_text = ""
        self.holding = 0
        self.max_holding = 0
        self.received = 0
        self.bodies: list[dict[str, Any]] = []  # every request body, as received
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-backend", daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> StubBackend:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stub backend did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def release(self) -> None:
        """Let every held request (and every later one) complete."""
        if self._release is not None:
            self._loop.call_soon_threadsafe(self._release.set)

    def hold(self) -> None:
        """Hold requests again (from the next one on)."""
        async def clear() -> None:
            assert self._release is not None
            self._release.clear()

        asyncio.run_coroutine_threadsafe(clear(), self._loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _shutdown(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(status=self.metrics_status, text=self.metrics_text)

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert self._release is not None
        self.bodies.append(body)
        self.received += 1
        self.holding += 1
        self.max_holding = max(self.max_holding, self.holding)
        try:
            await self._release.wait()
        finally:
            self.holding -= 1
        prompt = len(body["prompt"])
        output = body.get("max_tokens") or 1
        return web.json_response({
            "id": "cmpl-stub", "object": "text_completion", "model": "stub",
            "choices": [{"index": 0, "text": " x" * output, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                      "total_tokens": prompt + output}})
