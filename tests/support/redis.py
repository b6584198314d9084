"""A real ``redis-server`` (Debian's package; .ci/run installs it) on a free loopback port,
started by ``weighbridge.launch.redis_process``, for the tests of state shared through Redis.
``RedisServer`` can be stopped (or killed) and started again on the same port, as an outage
is."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from types import TracebackType

import httpx
import redis

from weighbridge.launch import redis_process


class RedisServer:
    def __init__(self, directory: Path | None = None, *, persistent: bool = False) -> None:
        """``persistent``: its data survives a kill (append-only, synced at every write)."""
        self.process = redis_process(Path(directory or tempfile.mkdtemp(
            prefix="weighbridge-redis-")), persistent=persistent)

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def port(self) -> int:
        port = httpx.URL(self.url).port
        assert port is not None
        return port

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           socket_timeout=5)

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing flushed that was not already."""
        self.process.signal(signal.SIGKILL)
        self.process.stop()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
