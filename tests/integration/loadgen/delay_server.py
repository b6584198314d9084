"""A streaming test server with injected, known delays, for the measurement tests.

``POST /v1/completions`` streams OpenAI-style chunks: the first content chunk ``ttft_ms``
after the request arrived, then one every ``itl_ms``; ``tokens_per_chunk`` tokens each;
with ``empty_first`` a role/empty chunk goes out first (immediately), which must not count
as the first token. Parameters come from the ``x-test`` header (JSON). The server notes the
monotonic time of every content chunk it wrote (one clock per machine on Linux), so a test
compares what the client measured with what the server did, not with what it meant to do.
``POST /stall?seconds=S`` holds every response that arrives before the stall ends until it
does. ``GET /timings/ID`` returns the notes of request ``ID``; ``GET /seen`` what named each
request's agent program on the wire: the harnesses' identity headers and the body's
``vllm_xargs``, in arrival order.

Run: ``python tests/integration/loadgen/delay_server.py PORT``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import orjson
from aiohttp import web

TIMINGS: dict[str, dict[str, object]] = {}
STALL_UNTIL = [0.0]
SEEN: list[dict[str, object]] = []
IDENTITY_HEADERS = ("x-claude-code-session-id", "x-claude-code-agent-id",
                    "x-claude-code-parent-agent-id", "x-session-id", "x-session-affinity",
                    "session-id", "thread-id")


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    params = orjson.loads(request.headers.get("x-test", "{}"))
    body = await request.json()
    test_id = str(params.get("id", ""))
    ttft = float(params.get("ttft_ms", 20)) / 1000
    itl = float(params.get("itl_ms", 5)) / 1000
    per_chunk = int(params.get("tokens_per_chunk", 1))
    SEEN.append({"headers": {h: request.headers[h] for h in IDENTITY_HEADERS
                             if h in request.headers},
                 "vllm_xargs": body.get("vllm_xargs"), "user": body.get("user")})
    tokens = int(body.get("max_tokens", 16))
    prompt = body.get("prompt")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
    await _sleep_until(STALL_UNTIL[0])
    start = time.monotonic()
    response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "x-weighbridge-backend": "test-backend",
                                           "x-weighbridge-queue-ms": "12.5"})
    await response.prepare(request)
    writes: list[float] = []
    if params.get("empty_first"):
        await response.write(b'data: {"choices": [{"index": 0, "text": ""}]}\n\n')
    sent = 0
    due = start + ttft
    while sent < tokens:
        n = min(per_chunk, tokens - sent)
        await _sleep_until(due)
        chunk = {"choices": [{"index": 0, "text": " tok" * n, "finish_reason": None}]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        writes.append(time.monotonic())
        sent += n
        due += itl
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
             "total_tokens": prompt_tokens + sent}
    await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    TIMINGS[test_id] = {"arrived": arrived, "writes": writes, "tokens": sent}
    return response


async def stall(request: web.Request) -> web.Response:
    STALL_UNTIL[0] = time.monotonic() + float(request.query["seconds"])
    return web.json_response({"until": STALL_UNTIL[0]})


async def timings(request: web.Request) -> web.Response:
    return web.json_response(TIMINGS.get(request.match_info["id"]))


async def seen(_request: web.Request) -> web.Response:
    return web.json_response(SEEN)


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/stall", stall)
    app.router.add_get("/timings/{id}", timings)
    app.router.add_get("/seen", seen)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None,
                access_log=None)


if __name__ == "__main__":
    main()
