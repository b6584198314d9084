"""The chaos tests' checks: a load generator's outcomes conserved in the sidecar's ledger,
the sidecar's resident memory, the emulator's slowdown knob, and a stub backend whose
/metrics misbehaves in chosen ways."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

from aiohttp import web

from tests.support import loopback
from tests.support.driver import Outcome
from tests.support.ledger import Ledger
from tests.support.stub_backend import StubBackend


def end_of(outcome: Outcome) -> str:
    """How the sidecar must have counted a request, from what its client saw."""
    if outcome.status == 200:
        return "completed" if outcome.error is None else "failed"  # an error event mid-stream
    if outcome.status == 0:
        return "transport_error"  # never reached an answer: counted nowhere we can check
    if outcome.reject_reason in ("backend_failed", "backend_unavailable"):
        return "failed"
    if outcome.reject_reason is not None:
        return "rejected"
    return "failed"  # the backend's own error answer, passed through


def assert_conserved(outcomes: Sequence[Outcome], delta: Ledger) -> dict[str, int]:
    """Every request the generator sent arrived at the sidecar and ended there exactly as
    its client saw it end; nothing is left in flight. Returns the generator's counts."""
    seen = collections.Counter(end_of(o) for o in outcomes)
    assert seen["transport_error"] == 0, [o.error for o in outcomes if o.status == 0][:5]
    assert delta.queued == delta.dispatched == 0, delta
    assert delta.arrived == len(outcomes), (delta, seen)
    assert delta.completed == seen["completed"], (delta, seen)
    assert delta.rejected_total == seen["rejected"], (delta, seen)
    assert delta.failed == seen["failed"], (delta, seen)
    assert delta.cancelled == 0, delta
    return dict(seen)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def set_slowdown(emulator_url: str, factor: float) -> None:
    """The emulator's chaos knob: every step takes ``factor`` times its modelled time."""
    response = loopback.post(emulator_url + "/admin/slowdown", json={"factor": factor}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json() == {"factor": factor}


class MetricsFaultBackend(StubBackend):
    """The sidecar suite's stub backend, with a /metrics that can also hang
    (``metrics_mode = "hang"``: the answer never comes) besides answering
    ``metrics_status`` with ``metrics_text`` (garbage, partial, or an error status)."""

    metrics_mode = "answer"

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_mode == "hang":
            await asyncio.sleep(3600)
        return await super()._metrics(request)
