"""Builders shared by the sidecar core tests."""

from __future__ import annotations

import itertools
from typing import Any

from weighbridge.sidecar.request import QueuedRequest

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
