"""aiohttp alone reading request bodies: the floor a test compares the sidecar's handling
of the same bytes with. ``python -m tests.support.body_sink PORT``: ``POST`` to any path
reads the body (up to the sidecar's default 4 MiB limit) and answers its length; ``GET
/health`` answers 200. On uvloop, as the sidecar runs."""

from __future__ import annotations

import sys

import uvloop
from aiohttp import web

from weighbridge.sidecar.config import DEFAULT_MAX_BODY_BYTES


async def read_body(request: web.Request) -> web.Response:
    return web.Response(text=str(len(await request.read())))


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main(port: int) -> None:
    uvloop.install()
    app = web.Application(client_max_size=DEFAULT_MAX_BODY_BYTES)
    app.router.add_post("/{path:.*}", read_body)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
