"""A prefix's holder held back for prefill alone (its prefill backlog, the tenant's pacing)
still takes a request of its prefix when the prefill its cache saves pays for the overshoot
(sidecar.eligibility.cache_pays_prefill); routing reads the index before the backend's first
answer (issue 38: vllm bench's prefix_repetition lost requests to engines that recomputed
the prefix)."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive, make_config
from tests.unit.sidecar.test_prefix_routing import cache_shape
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.request import QueuedRequest

PREFIX = list(range(1536))
# One step budget per tenant in prefill, two per backend (the derived defaults at 512).
PACED = GateLimits(max_inflight=1000, max_prefill_tokens_inflight=512,
                   max_backend_prefill_tokens=1024)


def paced_core() -> SchedulingCore:
    core = SchedulingCore(make_config(routing="prefix_aware"), gate_limits=PACED)
    for backend in core.fleet.names:
        core.on_backend_metrics(backend, cache_shape(0.0))
    return core


def send(core: SchedulingCore, ids: list[int], now: float, tenant: str = "a"):
    request = arrive(core, tenant, now, prompt_tokens=len(ids), max_tokens=8,
                     prefix=PromptPrefix(token_ids=ids))
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(now)
    return dispatch


def suffix(seed: int, n: int = 256) -> list[int]:
    return [100_000 + seed * 1000 + i for i in range(n)]


def test_the_holder_prefilling_another_prompt_keeps_its_prefix_s_next_request() -> None:
    core = paced_core()
    first = send(core, PREFIX + suffix(1), 0.0)
    core.on_completed(first.request, 1792, 8, 0.1, cached_tokens=0)
    holder = first.backend
    # The tenant's own prefix-free prompt now prefills on the holder: past its backlog and
    # the tenant's pacing (a tenant with nothing in prefill there would be let in anyway).
    other = send(core, suffix(2, 1792), 0.2)
    assert other.backend == holder
    again = send(core, PREFIX + suffix(3), 0.3)
    assert again.backend == holder
    assert again.request.predicted_cached_tokens == 1536
    assert core.routing_decisions[(holder, "affinity")] == 1


def test_a_backlog_the_cache_does_not_pay_for_sends_the_request_elsewhere() -> None:
    core = paced_core()
    first = send(core, PREFIX + suffix(1), 0.0)
    core.on_completed(first.request, 1792, 8, 0.1, cached_tokens=0)
    holder = first.backend
    # 3,000 of the tenant's tokens in prefill: with the request's 256, past the backlog's
    # 1,024 by more than the 1,536 its cache saves.
    other = send(core, suffix(2, 3000), 0.2)
    assert other.backend == holder
    again = send(core, PREFIX + suffix(3), 0.3)
    assert again.backend != holder


def test_routing_reads_the_index_before_the_first_answer() -> None:
    core = paced_core()
    first = send(core, PREFIX + suffix(1), 0.0)
    # No answer yet (none has reported cached tokens): the prefix's next request still goes
    # where the prefix was sent, and is charged its whole prompt until an answer reports.
    again = send(core, PREFIX + suffix(3), 0.05)
    assert again.backend == first.backend
    assert again.request.predicted_cached_tokens == 0
