"""The sidecar's request ledger read from its /metrics, and the state endpoints beside it:
every check ends with ``settled()``, which also asserts that the ledger balances
(``arrived == completed + rejected + cancelled + failed + queued + dispatched``). Counters
accumulate over a module's tests: compare *deltas* (``Ledger.__sub__``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support import loopback
from tests.support.metrics import Scrape, scrape
from tests.support.stack import ADMIN_KEY, auth
from tests.support.wait import wait_for


@dataclass(frozen=True)
class Ledger:
    """The sidecar's request ledger, summed over tenant and tier labels."""

    arrived: int
    completed: int
    rejected: dict[str, int]
    cancelled: int
    failed: int
    queued: int
    dispatched: int

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def __sub__(self, other: Ledger) -> Ledger:
        reasons = set(self.rejected) | set(other.rejected)
        return Ledger(
            self.arrived - other.arrived, self.completed - other.completed,
            {r: self.rejected.get(r, 0) - other.rejected.get(r, 0) for r in reasons
             if self.rejected.get(r, 0) != other.rejected.get(r, 0)},
            self.cancelled - other.cancelled, self.failed - other.failed,
            self.queued - other.queued, self.dispatched - other.dispatched)


def ledger(url: str, **labels: str) -> Ledger:
    """Read the ledger from /metrics and assert it balances (every request ends once)."""
    return ledger_of(scrape(url), **labels)


def ledger_of(s: Scrape, **labels: str) -> Ledger:
    """The ledger of ``labels`` in one scrape (several ledgers of one moment), balanced."""
    rejected: dict[str, int] = {}
    for got, value in s.samples.get("weighbridge_requests_rejected_total", ()):
        if all(got.get(k) == v for k, v in labels.items()):
            rejected[got["reason"]] = rejected.get(got["reason"], 0) + int(value)
    result = Ledger(
        arrived=int(s.total("weighbridge_requests_arrived_total", **labels)),
        completed=int(s.total("weighbridge_requests_completed_total", **labels)),
        rejected=rejected,
        cancelled=int(s.total("weighbridge_requests_cancelled_total", **labels)),
        failed=int(s.total("weighbridge_requests_failed_total", **labels)),
        queued=int(s.total("weighbridge_requests_queued", **labels)),
        dispatched=int(s.total("weighbridge_requests_dispatched", **labels)),
    )
    ends = (result.completed + result.rejected_total + result.cancelled + result.failed
            + result.queued + result.dispatched)
    assert result.arrived == ends, f"ledger does not balance: {result}"
    return result


def settled(url: str, timeout_s: float = 10.0, **labels: str) -> Ledger:
    """The ledger once nothing is queued or in flight (bounded wait); balanced."""
    return wait_for(lambda: (lambda lg: lg if lg.queued == lg.dispatched == 0 else None)(
        ledger(url, **labels)), timeout_s, what="the sidecar to drain")


def running(emulator_url: str) -> float:
    return scrape(emulator_url).total("vllm:num_requests_running")


def backend_finished(emulator_url: str) -> float:
    """Requests the emulator has finished (completed or aborted)."""
    return scrape(emulator_url).total("vllm:e2e_request_latency_seconds_count")


def admin_state(url: str) -> dict[str, Any]:
    response = loopback.get(url + "/admin/state", headers=auth(ADMIN_KEY), timeout=5)
    assert response.status_code == 200, response.text
    return response.json()
