"""The backends the scheduling core knows, one record each.

A ``Backend`` holds everything the core keeps about one engine: its admission gate, the KV
cache our in-flight requests will hold there (``sidecar.kv``), its prefix index
(``sidecar.prefix``), the load routing weighs (outstanding tokens, prompts in prefill, each
tenant's prompts in prefill for pacing), and its flags: healthy, draining, and what its
answers have shown of cached tokens. ``Fleet`` keeps the records in their configured order
(a backend's ``index`` is the routing tie-break and round robin's order) and each in-flight
request's *ticket*: the load it adds to its backend until its first token and its end.

Backends come and go with a reload (sidecar.reload): ``add`` joins one that takes no work
until it is marked healthy; ``retire`` stops new work to one while its requests finish, and
``forget_if_drained`` drops it once none is left. Whatever is known of a backend lives in
its record, so nothing has to be kept in step when one comes or goes.

Invariants (tests/unit/sidecar/test_fleet.py): a backend's ``outstanding_tokens``,
``prefill_tokens`` and in-flight count are the sums over its tickets; every record's
``index`` is its place in the fleet; a retired backend is forgotten exactly when its last
request ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weighbridge.sidecar.admission import AdmissionGate
from weighbridge.sidecar.kv import KvFootprint
from weighbridge.sidecar.prefix import PrefixIndex

if TYPE_CHECKING:
    from weighbridge.sidecar.config import Backend as BackendConfig
    from weighbridge.sidecar.request import QueuedRequest
    from weighbridge.vllm_metrics import BackendSample

__all__ = ["Backend", "Fleet"]


@dataclass(slots=True, eq=False)
class Backend:
    """One engine as the core knows it."""

    name: str
    index: int  # its place in the fleet: the last routing tie-break, round robin's order
    gate: AdmissionGate
    kv: KvFootprint  # what our in-flight requests will hold in its KV cache at their largest
    # Its prefix cache as the sidecar predicts it: empty until the engine's cache shape is
    # known from its /metrics.
    prefix: PrefixIndex
    priority_scheduling: bool = False  # it runs vLLM --scheduling-policy priority
    healthy: bool = True
    draining: bool = False  # a reload removed it: no new work, forgotten once it is empty
    # An answer showed it reports cached_tokens: only then are its predictions used (the
    # index learns from the first request on, but a prediction no answer can settle would
    # undercount the prefill backlog and the charges).
    reporting: bool = False
    # An answer lacked cached_tokens (vLLM without --enable-prompt-tokens-details): its
    # index is off, and its requests are charged the whole prompt.
    unreported: bool = False
    outstanding_tokens: int = 0  # prompts not yet prefilled plus expected remaining output
    prefill_tokens: int = 0  # prompt tokens dispatched there with no first token yet
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc at the last scrape
    # Prompt tokens each tenant has dispatched there whose prefill has not finished (no
    # first token yet), for prefill pacing; a tenant is here only while it has some.
    prefilling: Counter[str] = field(default_factory=Counter)

    @property
    def takes_work(self) -> bool:
        """Healthy and not draining: new work may go there."""
        return self.healthy and not self.draining

    @property
    def inflight(self) -> int:
        """Requests of ours in flight there (the gate counts them)."""
        return self.gate.inflight

    def observe(self, sample: BackendSample) -> None:
        """A scrape of its /metrics: the gate's view, and the prefix cache's shape and
        lookups."""
        self.gate.observe(sample)
        self.kv_cache_usage = sample.kv_cache_usage
        # vllm:cache_config_info's cache shape bounds what the prefix index may hold; an
        # engine without prefix caching, or whose answers say nothing of it, holds none.
        kv_blocks, block_size = sample.kv_blocks, sample.block_size
        if sample.prefix_caching is False or self.unreported:
            kv_blocks = 0
        if kv_blocks is not None and block_size:
            self.prefix.resize(int(kv_blocks), int(block_size))
        # The engine's lookups against the prompts sent it: the share of its cache they hold.
        queries = sample.prefix_cache_queries_total
        if queries is not None:
            self.prefix.observe_engine(sample.at_s, queries, sample.prefix_cache_hits_total)

    def predicted_cached(self, request: QueuedRequest) -> int:
        """The prompt tokens its prefix cache should hold for the request, where its answers
        have shown they say so (``reporting``); else none."""
        if request.prefix is None or not self.reporting:
            return 0
        return self.prefix.predict(request.prefix, request.prompt_tokens)

    def shared_blocks(self, request: QueuedRequest) -> tuple[int, ...]:
        """The prompt's full blocks as its engine names them, where it shares them between
        requests (its prefix cache is on and reported, and the index cuts the prompt in the
        engine's blocks); else none: the KV footprint counts it whole."""
        prefix, index = request.prefix, self.prefix
        block_size = self.kv.block_size
        if prefix is None or not index.capacity_blocks or not self.reporting \
                or index.block_size != block_size \
                or prefix.tokens_per_block(block_size) != block_size:
            return ()
        return prefix.blocks(block_size)

    def prefilled(self, tenant: str, tokens: int) -> None:
        """A prompt of ``tenant`` that counted ``tokens`` toward pacing left prefill."""
        prefilling = self.prefilling
        if not prefilling:
            return  # a prompt with nothing to compute (all cached) was never counted
        left = prefilling[tenant] - tokens
        if left > 0:
            prefilling[tenant] = left
        else:
            del prefilling[tenant]  # a Counter: no error when it was never counted

    def snapshot(self, now: float) -> dict[str, Any]:
        """What /admin/state shows of it."""
        return {
            "healthy": self.healthy,
            "inflight": self.inflight,
            "outstanding_tokens": self.outstanding_tokens,
            "prefill_tokens": self.prefill_tokens,
            "kv_cache_usage": self.kv_cache_usage,
            "gate": self.gate.snapshot(now),
            "draining": self.draining,
            "kv_footprint_blocks": self.kv.blocks(),
            "prefix_index": self.prefix.snapshot(reported=not self.unreported),
        }


@dataclass(slots=True)
class _Ticket:
    backend: Backend
    prompt_left: int  # prompt tokens until the first token says prefill is done
    output_left: int  # expected output tokens not yet streamed


class Fleet:
    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self._tickets: dict[str, _Ticket] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __getitem__(self, name: str) -> Backend:
        return self._backends[name]

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def __len__(self) -> int:
        return len(self._backends)

    @property
    def names(self) -> list[str]:
        return list(self._backends)

    @property
    def draining(self) -> frozenset[str]:
        """Backends a reload removed, still finishing what they have in flight."""
        return frozenset(b.name for b in self._backends.values() if b.draining)

    # ------------------------------------------------------------------ membership

    def add(self, name: str, gate: AdmissionGate, *, priority_scheduling: bool = False,
            healthy: bool = True) -> Backend:
        """A backend joins at the end of the order (a reload's: ``healthy`` False, no work
        until it is marked healthy)."""
        if name in self._backends:
            raise ValueError(f"backend {name!r} is already in the fleet")
        backend = Backend(name, len(self._backends), gate, KvFootprint(gate.limits.block_size),
                          PrefixIndex(0, gate.limits.block_size), priority_scheduling,
                          healthy=healthy)
        self._backends[name] = backend
        return backend

    def reconfigure(self, backends: Sequence[BackendConfig],
                    new_gate: Callable[[], AdmissionGate], *, healthy: bool = False,
                    ) -> tuple[frozenset[str], frozenset[str]]:
        """The configured backends (a reload's, sidecar.reload): a new one joins, taking no
        work until marked healthy unless ``healthy``; a kept one takes its flags; one no
        longer configured drains. Returns the names added and those gone (draining)."""
        names = {b.name for b in backends}
        gone = frozenset(b.name for b in self._backends.values()
                         if not b.draining and b.name not in names)
        added = []
        for spec in backends:
            record = self._backends.get(spec.name)
            if record is None:
                self.add(spec.name, new_gate(), priority_scheduling=spec.priority_scheduling,
                         healthy=healthy)
                added.append(spec.name)
            else:
                record.priority_scheduling = spec.priority_scheduling
        for name in gone:
            self.retire(name)
            self.forget_if_drained(name)
        return frozenset(added), gone

    def retire(self, name: str) -> None:
        """No new work to ``name``; its requests in flight finish."""
        self._backends[name].draining = True

    def forget_if_drained(self, name: str) -> bool:
        """Forget a retired backend once nothing of ours is in flight there; True if it was."""
        backend = self._backends.get(name)
        if backend is None or not backend.draining or backend.inflight:
            return False
        del self._backends[name]
        for i, other in enumerate(self._backends.values()):
            other.index = i
        return True

    # ------------------------------------------------------------------ load

    def dispatched(self, request_id: str, backend: Backend, prompt_tokens: int,
                   expected_output_tokens: int) -> None:
        """A request went to ``backend``: its prompt (what the engine computes) counts until
        its first token, its expected output until it streams."""
        if request_id in self._tickets:
            raise ValueError(f"request {request_id!r} is already in flight")
        ticket = _Ticket(backend, max(0, prompt_tokens), max(0, expected_output_tokens))
        self._tickets[request_id] = ticket
        backend.outstanding_tokens += ticket.prompt_left + ticket.output_left
        backend.prefill_tokens += ticket.prompt_left

    def streamed(self, request_id: str, tokens: int) -> None:
        """Output tokens streamed; the first one also says the prompt is prefilled."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            return
        produced = min(max(0, tokens), ticket.output_left)
        ticket.backend.outstanding_tokens -= ticket.prompt_left + produced
        ticket.backend.prefill_tokens -= ticket.prompt_left
        ticket.prompt_left = 0
        ticket.output_left -= produced

    def expect(self, request_id: str, output_left: int) -> None:
        """The request's remaining output is now expected at ``output_left`` tokens (its
        expected final length less what it streamed: decision 0018), up or down."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            return
        left = max(0, output_left)
        ticket.backend.outstanding_tokens += left - ticket.output_left
        ticket.output_left = left

    def finished(self, request_id: str) -> None:
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        b = ticket.backend
        b.outstanding_tokens -= ticket.prompt_left + ticket.output_left
        b.prefill_tokens -= ticket.prompt_left
