"""Why a request was turned away: the value every ingress check returns instead of raising.

Rejections are ordinary outcomes under load, not errors, so checks return a ``Reject`` and the
shell maps ``reason`` to the ``x-weighbridge-reject-reason`` header and an HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# The reasons the core produces; the shell adds its own (unauthorized, bad_request, ...).
RATE_LIMITED: Final = "rate_limited"
QUEUE_FULL: Final = "queue_full"
DEADLINE_UNMEETABLE: Final = "deadline_unmeetable"
# No backend serves the request's `model` (sidecar.catalog): vLLM's own 404.
MODEL_NOT_FOUND: Final = "model_not_found"
# A reload removed the request's tenant while the request was queued (sidecar.reload).
TENANT_REMOVED: Final = "tenant_removed"


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str
    # Seconds until the same request would pass (HTTP Retry-After). None when waiting cannot
    # help: the request is larger than the limit's whole capacity, or the cause is not timed.
    retry_after_s: float | None = None
    detail: str = ""  # human-readable, safe for the error body (no prompt, no key)

    @property
    def http_status(self) -> int:
        """The answer's status: 503 when the sidecar cannot meet the request's deadline (the
        service, not the client, is short), 404 for a model no backend serves, 429 for the
        client's own limits and queue."""
        if self.reason == MODEL_NOT_FOUND:
            return 404
        return 503 if self.reason in (DEADLINE_UNMEETABLE, TENANT_REMOVED) else 429
