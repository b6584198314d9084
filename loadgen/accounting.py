"""The load generator's records in the sidecar's terms, for the conservation check (every
request the generator sent arrived at the sidecar and ended there as its record says):
used by the soak benchmark and the chaos test against the sidecar's ledger.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from weighbridge.records import RequestRecord

__all__ = ["GENERATOR_PROBES", "records_by_end"]

# Requests a Locust run sends before its first recorded one, so without a record: one chat
# request measuring the chat template's framing (locust_plugin._detect_chat_overhead).
GENERATOR_PROBES = 1

# The generator's statuses against the sidecar's ends.
_SIDECAR_END = {"ok": "completed", "rejected": "rejected", "error": "failed",
                "cancelled": "cancelled", "timeout": "cancelled"}


# Answers the generator records as rejected (they carry a reject-reason header) that the
# sidecar counts as failed: the backend's fault, not a decision to turn the request away.
_SIDECAR_FAILURES = frozenset({"backend_failed", "backend_unavailable"})


def records_by_end(records: Sequence[RequestRecord]) -> dict[str, int]:
    """What the generator saw of each request it *sent*, in the sidecar's terms."""
    counts: dict[str, int] = collections.Counter()
    for r in records:
        if r.sent_s is None:
            continue
        if r.status == "rejected" and r.reason in _SIDECAR_FAILURES:
            counts["failed"] += 1
        else:
            counts[_SIDECAR_END[r.status]] += 1
    return dict(counts)
