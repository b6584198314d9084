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
# How long a binding lasts after its last dispatch (programs.affinity_ttl_s sets it).
TTL_S = 600.0

# A binding's key: the tenant and its session, so one tenant's ids never meet another's.
Key = tuple[str, str]


@register("scorer", "session_affinity")
class SessionAffinity:
    """Less the request's prompt tokens on the backend its session was last sent to, for
    requests that name a session (the program a call continues: ``programs.sources``, such
    as the ``x-session-id`` header or vllm-router's agentic context): a program's next call
    carries its context, which that engine's prefix cache holds, so the calls go back to it
    unless another has less load by more than the context's weight (the picker's bounded
    load rule). A binding lasts ``programs.affinity_ttl_s`` after its last dispatch, and
    replicas sharing state through Redis learn each other's within a sync. It needs no
    readable prompt
    (``prefix_affinity`` predicts the cache where the sidecar can read the prompt). The most
    recent ``SESSIONS`` sessions are remembered."""

    affinity = True

    def __init__(self) -> None:
        # (tenant, session) -> (backend, when last dispatched there), oldest first.
        self._last: OrderedDict[Key, tuple[str, float]] = OrderedDict()
        self.ttl_s = TTL_S

    @staticmethod
    def applies(request: QueuedRequest) -> bool:
        return request.session is not None

    def bound(self, tenant: str, session: str, now: float) -> str | None:
        """The backend ``tenant``'s ``session`` is bound to at ``now``, if any."""
        found = self._last.get((tenant, session))
        if found is None or now - found[1] > self.ttl_s:
            return None
        return found[0]

    def cost(self, request: QueuedRequest, backend: Backend) -> float:
        assert request.session is not None
        now = request.dispatched_s if request.dispatched_s is not None else request.arrival_s
        return -request.prompt_tokens \
            if self.bound(request.tenant, request.session, now) == backend.name else 0.0

    def dispatched(self, request: QueuedRequest, backend: Backend) -> None:
        session = request.session
        if session is None:
            return
        now = request.dispatched_s if request.dispatched_s is not None else request.arrival_s
        self.learn(request.tenant, session, backend.name, now)

    def learn(self, tenant: str, session: str, backend: str, at: float) -> None:
        """``tenant``'s ``session`` went to ``backend`` at ``at`` (here, or at another
        replica); an older binding than the one known is ignored."""
        key = (tenant, session)
        known = self._last.get(key)
        if known is not None and known[1] > at:
            return
        self._last[key] = (backend, at)
        self._last.move_to_end(key)
        if len(self._last) > SESSIONS:
            self._last.popitem(last=False)
