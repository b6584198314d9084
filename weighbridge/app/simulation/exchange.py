"""Several sidecar replicas' exchange through Redis, in memory and in virtual time: what
``weighbridge.sidecar.shared.SharedState`` carries between replicas that decides a share
(docs/sidecar.md, "Several replicas"), without the sockets.

Each replica, every ``sync_s``, publishes its load (per pool and tenant: in flight, queued)
and adopts the others' summed (``Replica.set_foreign_load``); every ``SERVICE_SYNC_S`` it
also adds the service it charged to the shared totals and charges to its own queues what
the totals of the flows it wants grew by beyond its own part (``Replica.charge_foreign``),
only for a flow it read at its previous service sync, as ``SharedState`` does. The replicas
sync in turn at one instant (one event), each seeing what those before it published.

What live has and this does not: Redis's round trips (each exchange here is instant), the
shared rate-limit buckets (each core keeps its own limiter: a simulated run with replicas
judges shares, not limits), the output estimates and the prefix stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from weighbridge.sidecar import SERVICE_SYNC_S, Replica

__all__ = ["ReplicaExchange"]

Flow = tuple[str, str, str]  # (pool, tier, tenant)
LoadKey = tuple[str, str]  # (pool, tenant)


class ReplicaExchange:
    def __init__(self, replicas: Sequence[Replica], sync_s: float) -> None:
        if sync_s <= 0:
            raise ValueError("sync_s must be positive")
        self.replicas = list(replicas)
        self.sync_s = sync_s
        # Load exchanges per service sync, as SharedState's loop counts them.
        self._every = max(1, round(SERVICE_SYNC_S / sync_s))
        self._tick = 0
        self._loads: list[dict[LoadKey, tuple[int, bool]]] = [{} for _ in self.replicas]
        self._served: dict[Flow, float] = {}  # the shared totals (Redis's served hash)
        # Per replica: flow -> (its service sync's number, the total it read then).
        self._seen: list[dict[Flow, tuple[int, float]]] = [{} for _ in self.replicas]
        self._syncs = 0

    def tick(self) -> None:
        """One ``sync_s`` period's exchange of every replica, in turn."""
        self._tick += 1
        service = self._tick % self._every == 0
        if service:
            self._syncs += 1
        for i, replica in enumerate(self.replicas):
            if service:
                self._service(i, replica)
            self._loads[i] = replica.local_load()
            foreign: dict[LoadKey, tuple[int, bool]] = {}
            for j, load in enumerate(self._loads):
                if j == i:
                    continue
                for key, (inflight, backlogged) in load.items():
                    was = foreign.get(key, (0, False))
                    foreign[key] = (was[0] + inflight, was[1] or backlogged)
            replica.set_foreign_load(foreign)

    def _service(self, i: int, replica: Replica) -> None:
        booked = replica.take_booked()
        for flow, turns in booked.items():
            self._served[flow] = self._served.get(flow, 0.0) + turns
        seen = self._seen[i]
        for flow in sorted(set(booked) | set(replica.queued_flows())):
            total = self._served.get(flow, 0.0)
            last = seen.get(flow)
            seen[flow] = (self._syncs, total)
            if last is not None and last[0] == self._syncs - 1:
                foreign = total - last[1] - booked.get(flow, 0.0)
                if abs(foreign) > 1e-9:
                    replica.charge_foreign(*flow, foreign)
