"""A vLLM stand-in served from a thread, whose answers and /metrics a test controls."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web

from weighbridge.launch import free_port


class StubBackend:
    """A vLLM stand-in served from a thread: /health answers 200, /metrics answers
    ``metrics_status`` with ``metrics_text`` (500 by default: unreachable metrics), and
    /v1/completions (and chat, answered alike) holds each request until the test calls
    ``release()``, counting how many it holds at once."""

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
        app.router.add_post("/v1/chat/completions", self._completions)  # answered the same
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
        prompt = len(body.get("prompt") or body.get("messages") or ())
        output = body.get("max_completion_tokens") or body.get("max_tokens") or 1
        return web.json_response({
            "id": "cmpl-stub", "object": "text_completion", "model": "stub",
            "choices": [{"index": 0, "text": " x" * output, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                      "total_tokens": prompt + output}})
