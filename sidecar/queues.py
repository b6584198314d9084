"""A tenant's own queue, ordered by ``QueuedRequest.order_key`` (priority, deadline, with
``shortest_prompt_first`` arrival delayed by the prompt's size, arrival), and the bounds on it.

Cancellation (a client that went away while queued) is lazy: the request leaves the live
index at once, so counts and token totals are exact immediately, and its heap entry is dropped
when it reaches the top. Cancel is O(1), push/pop O(log n) amortised.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from weighbridge.sidecar.rejection import QUEUE_FULL, Reject
from weighbridge.sidecar.request import QueuedRequest

_Entry = tuple[tuple[int, float, float, float, int], QueuedRequest]


class TenantQueue:
    __slots__ = ("_heap", "_live", "_tokens")

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: dict[str, QueuedRequest] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    @property
    def tokens(self) -> int:
        """Tokens the queued requests are expected to cost the engine (``computed_tokens``)."""
        return self._tokens

    def push(self, request: QueuedRequest) -> None:
        if request.id in self._live:
            raise ValueError(f"request {request.id!r} is already queued")
        # order_key ends with the scheduler's unique seq, so entries never compare requests.
        heapq.heappush(self._heap, (request.order_key(), request))
        self._live[request.id] = request
        self._tokens += request.computed_tokens

    def _drop_dead(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1].id) is not heap[0][1]:
            heapq.heappop(heap)

    def peek(self) -> QueuedRequest | None:
        self._drop_dead()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> QueuedRequest:
        self._drop_dead()
        if not self._heap:
            raise IndexError("pop from an empty TenantQueue")
        request = heapq.heappop(self._heap)[1]
        del self._live[request.id]
        self._tokens -= request.computed_tokens
        return request

    def remove(self, request_id: str) -> QueuedRequest | None:
        request = self._live.pop(request_id, None)
        if request is None:
            return None
        self._tokens -= request.computed_tokens
        # Dead entries are otherwise only dropped from the top; a tenant that cancels from
        # the middle over and over must not grow the heap without bound.
        if len(self._heap) > 2 * len(self._live) + 32:
            self._heap = [(r.order_key(), r) for r in self._live.values()]
            heapq.heapify(self._heap)
        return request

    def first(self, count: int) -> list[QueuedRequest]:
        """Up to ``count`` of the next requests in dispatch order, looked for in the heap's
        top ``count`` levels, where they all are unless cancelled ones sit among them
        (O(2^count))."""
        self._drop_dead()
        live = self._live
        top = (e for e in self._heap[:(1 << count) - 1] if live.get(e[1].id) is e[1])
        return [request for _, request in heapq.nsmallest(count, top)]

    def ordered(self, limit: int | None = None) -> list[QueuedRequest]:
        """The queued requests in dispatch order (for /admin/state; O(n log n))."""
        requests = sorted(self._live.values(), key=QueuedRequest.order_key)
        return requests if limit is None else requests[:limit]


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """``Limits.max_queued`` and ``Limits.max_queued_tokens``, over all of a tenant's tiers."""

    max_queued: int = 1000
    max_queued_tokens: int | None = None

    def check(self, queued: int, queued_tokens: int, request_tokens: int) -> Reject | None:
        if queued + 1 > self.max_queued:
            return Reject(QUEUE_FULL, None, f"{queued} requests queued (max_queued)")
        if (
            self.max_queued_tokens is not None
            and queued > 0  # an empty queue takes any one request, or it could never be sent
            and queued_tokens + request_tokens > self.max_queued_tokens
        ):
            return Reject(
                QUEUE_FULL, None, f"{queued_tokens} tokens queued (max_queued_tokens)"
            )
        return None
