from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend
    from weighbridge.sidecar.request import QueuedRequest

# Sessions remembered: the least recently dispatched is forgotten first, so a client that
# sends a new session id with every request cannot grow the map without bound.
SESSIONS = 65_536


@register("scorer", "session_affinity")
class SessionAffinity:
    """Less the request's prompt tokens on the backend its session was last sent to, for
    requests that name a session (the client's ``x-session-id`` header): a conversation's
    next turn carries its history, which that engine's prefix cache holds, so the turns go
    back to it unless another has less load by more than the history's weight. It needs no
    readable prompt (``prefix_affinity`` predicts the cache where the sidecar can read the
    prompt). The most recent ``SESSIONS`` sessions are remembered."""

    affinity = True

    def __init__(self) -> None:
        self._last: OrderedDict[str, str] = OrderedDict()  # session -> backend, oldest first

    @staticmethod
    def applies(request: QueuedRequest) -> bool:
        return request.session is not None

    def cost(self, request: QueuedRequest, backend: Backend) -> float:
        assert request.session is not None
        return -request.prompt_tokens if self._last.get(request.session) == backend.name \
            else 0.0

    def dispatched(self, request: QueuedRequest, backend: Backend) -> None:
        session = request.session
        if session is None:
            return
        self._last[session] = backend.name
        self._last.move_to_end(session)
        if len(self._last) > SESSIONS:
            self._last.popitem(last=False)
