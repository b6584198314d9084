"""Routing: which backend takes a request, once fairness has chosen it (sidecar.cycle).

A **scorer** (``Scorer``) says what sending the request to a backend costs, in tokens: its
load (``least_tokens``: the token work outstanding there) or, for an *affinity* scorer, less
what the backend already holds of it (``prefix_affinity``: the prompt tokens its prefix
cache is predicted to hold), as a negative cost. A route sums its scorers, each times its
weight. A **picker** (``Picker``) chooses: among the backends that may take the request by
the summed load (``pick``), then, when an affinity scorer has something to say of the
request, weighing affinity against load among the backends that may take it or hold it
(``weigh``; ``bounded_load`` keeps a hot prefix from piling onto one engine).

The configuration names a route by its parts (``routing: {picker: ..., scorers: {name:
weight}}``) or by a preset (``PRESETS``: ``prefix_aware``, ``least_tokens``,
``least_requests``, ``round_robin``). Each scorer or picker is one module here with one
``@register`` line; tests/unit/sidecar/test_routing_conformance.py runs over every one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from weighbridge.sidecar.plugins import plugin

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet
    from weighbridge.sidecar.request import QueuedRequest

__all__ = ["PRESETS", "Candidate", "Picker", "Route", "Scorer", "WeighsNoAffinity",
           "route_parts"]

# Today's routing names, as a picker over weighted scorers.
PRESETS: dict[str, tuple[str, dict[str, float]]] = {
    "prefix_aware": ("bounded_load", {"least_tokens": 1.0, "prefix_affinity": 2.0}),
    "least_tokens": ("least_loaded", {"least_tokens": 1.0}),
    "least_requests": ("least_requests", {}),
    "round_robin": ("round_robin", {}),
}


class Scorer(Protocol):
    """What sending a request to a backend costs, in tokens (lower is better)."""

    name: ClassVar[str]
    # It scores what a backend holds of the request (a negative cost: the tokens held), not
    # its load; a route weighs it against load only for requests it ``applies`` to.
    affinity: ClassVar[bool]

    def applies(self, request: QueuedRequest) -> bool:
        """Whether it has anything to say of the request (a load scorer: always)."""
        ...

    def cost(self, request: QueuedRequest, backend: Backend) -> float: ...

    def dispatched(self, request: QueuedRequest, backend: Backend) -> None:
        """The request went to ``backend`` (what an affinity scorer may remember)."""
        ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """One backend as a picker weighs affinity against load for a request."""

    load: int  # outstanding tokens: what the load bound is judged on
    inflight: int  # requests in flight there
    cost: float  # the route's load scorers, summed with their weights
    affinity: float  # its affinity scorers, summed with their weights (<= 0)
    index: int = 0  # its place among the backends: the last tie-break


class Picker(Protocol):
    """The choice among the backends that may take a request."""

    name: ClassVar[str]

    def pick(self, candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        """One of ``candidates`` (never empty; ``fleet``'s backends that may take the
        request, in its order), each at the route's summed load ``cost``."""
        ...

    def weigh(self, chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        """With affinity somewhere among ``candidates`` (at least two): the backend, and why
        (``affinity``, ``load`` or ``bounded``); ``chosen`` is ``pick``'s."""
        ...

    def dispatched(self, backend: Backend, fleet: Fleet) -> None:
        """A request went to ``backend``."""
        ...


class WeighsNoAffinity:
    """A picker's part when it weighs no affinity: its pick stands (``load``), and it
    keeps nothing of a dispatch."""

    def weigh(self, chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        del candidates, prompt_tokens
        return chosen, "load"

    def dispatched(self, backend: Backend, fleet: Fleet) -> None:
        del backend, fleet


def route_parts(routing: Any) -> tuple[str, dict[str, float]]:
    """(picker, {scorer: weight}) of a configured route: a preset's name, or its parts."""
    if isinstance(routing, str):
        return PRESETS[routing]
    return routing.picker, dict(routing.scorers)


class Route:
    """A picker over weighted scorers, built from the configuration's ``routing``."""

    def __init__(self, routing: Any) -> None:
        picker, scorers = route_parts(routing)
        self.picker: Picker = plugin("picker", picker)()
        parts = [(plugin("scorer", name)(), weight) for name, weight in scorers.items()]
        self.load: tuple[tuple[Scorer, float], ...] = tuple(
            (s, w) for s, w in parts if not s.affinity)
        self.affinity: tuple[tuple[Scorer, float], ...] = tuple(
            (s, w) for s, w in parts if s.affinity)
        self.scorers = tuple(s for s, _ in parts)

    def session_ttl(self, ttl_s: float) -> None:
        """How long a session stays bound to a backend, for the scorers that bind them
        (``session_affinity``: ``programs.affinity_ttl_s``)."""
        for scorer in self.scorers:
            if hasattr(scorer, "ttl_s"):
                scorer.ttl_s = ttl_s

    def learn_session(self, tenant: str, session: str, backend: str, at: float) -> None:
        """Another replica sent ``tenant``'s ``session`` to ``backend`` (told at ``at``),
        for the scorers that bind sessions."""
        for scorer in self.scorers:
            learn = getattr(scorer, "learn", None)
            if learn is not None:
                learn(tenant, session, backend, at)

    def pick(self, request: QueuedRequest, candidates: Sequence[Backend],
             fleet: Fleet) -> Backend:
        """The picker's choice among ``candidates`` by the summed load scorers."""
        load = self.load

        def cost(backend: Backend) -> float:
            return sum(w * s.cost(request, backend) for s, w in load)

        return self.picker.pick(candidates, cost, fleet)

    def affine(self, request: QueuedRequest) -> bool:
        """Whether an affinity scorer has anything to say of ``request``."""
        return any(s.applies(request) for s, _ in self.affinity)

    def held(self, request: QueuedRequest, backend: Backend) -> tuple[int, float]:
        """(tokens ``backend`` holds of the request, its weighted affinity cost) by the
        affinity scorers that apply to it."""
        held, affinity = 0, 0.0
        for scorer, weight in self.affinity:
            if scorer.applies(request):
                cost = scorer.cost(request, backend)
                held -= int(cost)
                affinity += weight * cost
        return held, affinity

    def weigh(self, request: QueuedRequest, chosen: str,
              held: Mapping[str, tuple[int, float]], fleet: Fleet) -> tuple[str, str]:
        """The backend among those of ``held`` (``chosen``, ``pick``'s, included), affinity
        weighed against load by the picker, and why."""
        if len(held) < 2 or max(h for h, _ in held.values()) <= 0:
            return chosen, "load"
        candidates = {}
        for name, (_, affinity) in held.items():
            backend = fleet[name]
            candidates[name] = Candidate(
                backend.outstanding_tokens, backend.inflight,
                sum(w * s.cost(request, backend) for s, w in self.load), affinity,
                backend.index)
        return self.picker.weigh(chosen, candidates, request.prompt_tokens)

    def dispatched(self, request: QueuedRequest, backend: Backend, fleet: Fleet) -> None:
        self.picker.dispatched(backend, fleet)
        for scorer in self.scorers:
            scorer.dispatched(request, backend)
