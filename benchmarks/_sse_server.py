"""Minimal SSE servers for benchmarks/http_stack.py, one per candidate hot-path stack.

    python -m benchmarks._sse_server --stack aiohttp-uvloop --encoder orjson --port 8100

``GET /stream?n=N`` answers ``text/event-stream`` with N chunks shaped like vLLM's completion
chunks (``data: {json}\\n\\n``), encoded one by one, then ``data: [DONE]``. Each chunk is built,
encoded and written on its own, and the handler yields to the event loop between chunks: the
emulator and the sidecar write a chunk when an engine step or an upstream read wakes them, so
many streams interleave and every chunk pays a task switch, an encode and a write.
``GET /health`` answers 200 for the launcher.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

STACKS = ("aiohttp-uvloop", "aiohttp-asyncio", "starlette-uvicorn")
ENCODERS = ("orjson", "json")
MAX_CHUNKS = 1_000_000  # bound on one request's stream


def _encoder(name: str) -> Callable[[Any], bytes]:
    if name == "orjson":
        return orjson.dumps
    # Compact separators: the same bytes on the wire as orjson, so only the encoder differs.
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    return lambda obj: dumps(obj).encode()


def _chunks(n: int, encode: Callable[[Any], bytes]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        created = int(time.time())
        for _ in range(min(n, MAX_CHUNKS)):
            chunk = {"id": "cmpl-bench", "object": "text_completion", "created": created,
                     "model": "bench", "choices": [{"index": 0, "text": " tok",
                                                    "logprobs": None, "finish_reason": None,
                                                    "stop_reason": None}],
                     "usage": None}
            yield b"data: " + encode(chunk) + b"\n\n"
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    return gen()


def _count(query: str | None) -> int:
    try:
        return max(0, min(int(query or "100"), MAX_CHUNKS))
    except ValueError:
        return 100


def serve_aiohttp(host: str, port: int, encode: Callable[[Any], bytes], uvloop_: bool) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for data in _chunks(_count(request.query.get("n")), encode):
            await response.write(data)
        await response.write_eof()
        return response

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/health", health)
    if uvloop_:
        import uvloop

        uvloop.install()
    web.run_app(app, host=host, port=port, print=None, access_log=None)


def serve_starlette(host: str, port: int, encode: Callable[[Any], bytes]) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(_chunks(_count(request.query_params.get("n")), encode),
                                 media_type="text/event-stream")

    async def health(_request: Request) -> Response:
        return Response(status_code=200)

    app = Starlette(routes=[Route("/stream", stream), Route("/health", health)])
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stack", choices=STACKS, required=True)
    parser.add_argument("--encoder", choices=ENCODERS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        parser.error("benchmark servers listen on loopback only")
    encode = _encoder(args.encoder)
    if args.stack == "starlette-uvicorn":
        serve_starlette(args.host, args.port, encode)
    else:
        serve_aiohttp(args.host, args.port, encode, uvloop_=args.stack == "aiohttp-uvloop")


if __name__ == "__main__":
    main()
