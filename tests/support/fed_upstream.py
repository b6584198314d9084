"""A backend connection of the sidecar's upstream client fed by the test itself: no socket,
so each ``conn.data_received(piece)`` is exactly one read of the bytes the test chose (every
byte boundary of a response can be tried)."""

from __future__ import annotations

from weighbridge.sidecar.upstream import Upstream, UpstreamResponse, _Connection


class FakeTransport:
    """What ``_Connection`` asks of its transport, recorded: closed, reading paused."""

    def __init__(self) -> None:
        self.closing = False
        self.paused = False

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        self.closing = True

    close = abort

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def fed_response() -> tuple[_Connection, UpstreamResponse]:
    """A connection on a :class:`FakeTransport` and the response it awaits."""
    conn = _Connection(Upstream(), ("http", "h", 1))
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    return conn, conn.start(b"")
