"""``weighbridge.launch.redis_answers``, the readiness check of a started redis-server: False,
never an exception, whatever answers (or does not) at the address, and within its 1 s
timeout, not retried. A real Redis answering True: tests/integration/sidecar/
test_shared_state.py, whose server starts through it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from weighbridge.launch import free_port, redis_answers


def test_nothing_listening_is_no_redis() -> None:
    assert redis_answers("127.0.0.1", free_port()) is False


def test_an_unknown_host_is_no_redis() -> None:
    assert redis_answers("no-such-host.invalid", 6379) is False


@pytest.fixture
def silent() -> Iterator[int]:
    """A listener that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_server_that_never_answers_is_no_redis_after_the_timeout(silent: int) -> None:
    started = time.monotonic()
    assert redis_answers("127.0.0.1", silent) is False
    assert time.monotonic() - started < 3  # one 1 s timeout, no retries


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_another_protocol_is_no_redis() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert redis_answers("127.0.0.1", server.server_address[1]) is False
    finally:
        server.shutdown()
        server.server_close()
