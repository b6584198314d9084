"""The sidecar's HTTP headers: a contract between the sidecar, the load generator, the
simulation and anyone's client (docs/sidecar.md, "HTTP interface"). Lower case, as HTTP/2
sends them and aiohttp compares them.
"""

from __future__ import annotations

__all__ = ["BACKEND", "DEADLINE_MS", "QUEUE_MS", "REJECT_REASON", "TENANT", "TIER"]

# Request headers a client may send.
TIER = "x-weighbridge-tier"  # the tier to schedule the request in (at or below its own)
DEADLINE_MS = "x-weighbridge-deadline-ms"  # reject early if it cannot start by then

# Response headers the sidecar sets.
TENANT = "x-weighbridge-tenant"  # who the key belongs to
QUEUE_MS = "x-weighbridge-queue-ms"  # the wait in the sidecar's queue
BACKEND = "x-weighbridge-backend"  # the backend that served it
REJECT_REASON = "x-weighbridge-reject-reason"  # why it was turned away (every error answer)
