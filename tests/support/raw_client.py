"""A hand-driven HTTP/1.1 client: one request on its own TCP connection, read byte by
byte, so a test controls exactly when the client goes away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
import orjson


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
