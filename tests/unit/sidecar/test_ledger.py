from __future__ import annotations

import pytest

from weighbridge.sidecar.ledger import Ledger, LedgerError, Outcome


def test_every_request_ends_exactly_once_and_the_identity_holds() -> None:
    ledger = Ledger()
    for k in range(6):
        ledger.arrive(f"r{k}", "a" if k % 2 else "b", "standard")
    ledger.dispatch("r0")
    ledger.dispatch("r1")
    ledger.end("r0", Outcome.COMPLETED)
    ledger.end("r1", Outcome.FAILED)
    ledger.end("r2", Outcome.CANCELLED)
    ledger.end("r3", Outcome.REJECTED, "queue_full")
    ledger.dispatch("r4")
    ledger.requeue("r4")
    ledger.rejected_on_arrival("", "", "unauthorized")
    total = ledger.total()
    assert total.as_dict() == {
        "arrivals": 7,
        "completed": 1,
        "rejected": {"queue_full": 1, "unauthorized": 1},
        "cancelled": 1,
        "failed": 1,
        "queued": 2,
        "dispatched": 0,
    }
    assert total.balanced
    assert all(t.balanced for t in ledger.tallies().values())
    assert ledger.by_tenant()["a"].arrivals == 3
    assert ledger.by_tier()["standard"].arrivals == 6
    with pytest.raises(LedgerError):
        ledger.end("r0", Outcome.COMPLETED)
    with pytest.raises(LedgerError):
        ledger.arrive("r5", "a", "standard")
    with pytest.raises(LedgerError):
        ledger.requeue("r5")
    ledger.dispatch("r5")
    with pytest.raises(LedgerError):
        ledger.dispatch("r5")
    assert ledger.snapshot()["by_tenant_tier"]["a/standard"]["dispatched"] == 1
