"""Prefix affinity across the dispatch pass's two kinds of backend: a backend at its prefill
backlog is in headroom, and a light tenant with nothing of its own in prefill there may
still go to it (sidecar.eligibility.PrefillBacklogShare). Its cached history there is then a
choice for prefix_aware even while another backend is open: a flooded victim's next turn
stays where its history is instead of prefilling all of it elsewhere (issue 38)."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive, make_config
from tests.unit.sidecar.test_prefix_routing import cache_shape
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.request import QueuedRequest


def test_a_light_tenants_next_turn_goes_back_to_its_history_at_the_backlog() -> None:
    limits = GateLimits(max_inflight=1000, max_backend_prefill_tokens=100)
    core = SchedulingCore(make_config(routing="prefix_aware"), gate_limits=limits)
    for backend in core.fleet.names:
        core.on_backend_metrics(backend, cache_shape(0.0))
    history = list(range(400))
    first = arrive(core, "a", 0.0, prompt_tokens=400, max_tokens=8,
                   prefix=PromptPrefix(token_ids=history))
    assert isinstance(first, QueuedRequest)
    (d1,) = core.dispatch_ready(0.0)
    core.on_completed(d1.request, 400, 8, 0.1, cached_tokens=0)
    # A flood's prompt on the same backend puts it at its prefill backlog (150 >= 100).
    arrive(core, "b", 0.2, prompt_tokens=150, max_tokens=8)
    (flood,) = core.dispatch_ready(0.2)
    assert flood.backend == d1.backend
    # The next turn: the other backend is open, the history's backend in headroom; the
    # light tenant with nothing in prefill there may go, and its 400 cached tokens win.
    arrive(core, "a", 0.3, prompt_tokens=440, max_tokens=8,
           prefix=PromptPrefix(token_ids=history + list(range(500, 540))))
    (d2,) = core.dispatch_ready(0.3)
    assert d2.backend == d1.backend
    assert d2.request.predicted_cached_tokens == 400  # 25 full blocks
    assert core.routing_decisions[(d1.backend, "affinity")] == 1
    # The flood's next prompt, with one of its own in prefill there, is not let in.
    arrive(core, "b", 0.4, prompt_tokens=150, max_tokens=8)
    (flood2,) = core.dispatch_ready(0.4)
    assert flood2.backend != d1.backend
