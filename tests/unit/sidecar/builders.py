"""Builders shared by the sidecar core tests."""

from __future__ import annotations

import itertools
from typing import Any

from weighbridge.sidecar.admission import AdmissionGate, GateLimits
from weighbridge.sidecar.fleet import Fleet
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.routing import Route
from weighbridge.sidecar.routing.prefix_affinity import CACHE_WEIGHT

_ids = itertools.count()


def make_request(
    tenant: str = "a",
    tier: str = "standard",
    *,
    endpoint: str = "/v1/chat/completions",
    prompt: int = 100,
    output: int = 20,
    max_tokens: int | None = 1000,
    arrival: float = 0.0,
    **fields: Any,
) -> QueuedRequest:
    return QueuedRequest(
        id=fields.pop("id", f"r{next(_ids)}"),
        tenant=tenant,
        tier=tier,
        endpoint=endpoint,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        estimated_output_tokens=output,
        arrival_s=arrival,
        **fields,
    )


def make_fleet(*names: str) -> Fleet:
    """A fleet of healthy backends with fixed admission limits, in the order given."""
    fleet = Fleet()
    for name in names:
        fleet.add(name, AdmissionGate(GateLimits()))
    return fleet


def send(fleet: Fleet, request_id: str, backend: str, prompt_tokens: int,
         output_tokens: int) -> None:
    """A dispatch as the core records it: the gate's count, then the ticket."""
    record = fleet[backend]
    record.gate.on_dispatched(0.0)
    fleet.dispatched(request_id, record, prompt_tokens, output_tokens)


def prefer(fleet: Fleet, cached: dict[str, int], chosen: str,
           prompt_tokens: int) -> tuple[str, str]:
    """prefix_aware's weighing of the prompt tokens each backend's cache holds (``cached``)
    against the fleet's load, for a request of ``prompt_tokens`` ``pick`` gave ``chosen``."""
    held = {name: (n, -CACHE_WEIGHT * n) for name, n in cached.items()}
    return Route("prefix_aware").weigh(make_request(prompt=prompt_tokens), chosen, held, fleet)
