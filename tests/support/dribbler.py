"""The slow-body attack, as a process of its own so its sending costs the measured
processes nothing: ``python -m tests.support.dribbler URL KEY CONNECTIONS SECONDS RATE``.

Each of CONNECTIONS connections declares a ``Content-Length`` of the sidecar's default
limit (4 MiB), sends all of it but 4 KiB at once, then one byte per TCP segment, RATE a
second, for SECONDS; then it closes (the body is never complete). Prints the bytes it
dribbled in all, then exits."""

from __future__ import annotations

import asyncio
import socket
import sys

import httpx

from weighbridge.sidecar.config import DEFAULT_MAX_BODY_BYTES

HELD_BACK = 4096  # more than any run dribbles, so no body completes


async def attack(url: str, key: str, connections: int, seconds: float, rate: float) -> int:
    target = httpx.URL(url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {target.host}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {DEFAULT_MAX_BODY_BYTES}\r\n\r\n").encode()
    bulk = b'{"prompt": "' + b"x" * (DEFAULT_MAX_BODY_BYTES - HELD_BACK - 12)
    writers = []
    for _ in range(connections):
        _, writer = await asyncio.open_connection(target.host, target.port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a segment per byte
        writer.write(head + bulk)
        writers.append(writer)
    for writer in writers:
        await writer.drain()
    loop = asyncio.get_running_loop()
    started, sent = loop.time(), 0
    while (elapsed := loop.time() - started) < seconds:
        due = int(elapsed * rate)
        while sent < due:
            for writer in writers:
                writer.write(b"x")
            sent += 1
        await asyncio.sleep(1 / rate)
    for writer in writers:
        writer.transport.abort()
    return sent * connections


def main() -> None:
    url, key, connections, seconds, rate = sys.argv[1:6]
    print(asyncio.run(attack(url, key, int(connections), float(seconds), float(rate))))


if __name__ == "__main__":
    main()
