"""Every registered scorer and picker (sidecar.plugins), as a route uses them: a scorer's
cost is finite, a load scorer's never negative and an affinity scorer's never positive; a
picker chooses one of the backends offered, without side effects, and says why it weighed
affinity as it did; and every picker over every scorer, as a configured route in the
scheduling core, sends each request to a backend that may take it and leaves no load behind."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_fleet, make_request, send
from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.config import Routing
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.fleet import Fleet
from weighbridge.sidecar.plugins import registered
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.routing import Candidate, Route
from weighbridge.vllm_metrics import BackendSample

SCORERS = sorted(registered("scorer"))
PICKERS = sorted(registered("picker"))
BLOCK = 16

# Per backend: (prompt tokens in flight, expected output, KV usage, whether it holds the
# conversation's first 64 tokens in its prefix index).
backends = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 500),
                              st.one_of(st.none(), st.floats(0, 1)), st.booleans()),
                    min_size=1, max_size=5)
HISTORY = list(range(96))


def fleet_of(rows: list[tuple[int, int, float | None, bool]]) -> Fleet:
    fleet = make_fleet(*(f"b{i}" for i in range(len(rows))))
    for i, (prompt, output, usage, holds) in enumerate(rows):
        record = fleet[f"b{i}"]
        record.kv_cache_usage = usage
        if prompt or output:
            send(fleet, f"r{i}", record.name, prompt, output)
        record.prefix.resize(1000, BLOCK)
        if holds:
            record.prefix.sent(PromptPrefix(token_ids=HISTORY[:64]))
    return fleet


def request() -> QueuedRequest:
    """A conversation's turn: its prompt readable, its session named."""
    return make_request(prompt=len(HISTORY), prefix=PromptPrefix(token_ids=HISTORY),
                        session="conversation")


@pytest.mark.parametrize("scorer", SCORERS)
@given(rows=backends)
def test_a_scorer_costs_tokens_of_its_sign(scorer: str, rows) -> None:
    part = registered("scorer")[scorer]
    assert part.name == scorer and (part.__doc__ or "").strip()
    fleet, r = fleet_of(rows), request()
    s = part()
    if not part.affinity:
        assert s.applies(r) and s.applies(make_request())
    if not s.applies(r):
        return
    s.dispatched(r, fleet[fleet.names[-1]])  # what an affinity scorer may remember
    for backend in fleet:
        cost = s.cost(r, backend)
        assert math.isfinite(cost)
        assert cost <= 0 if part.affinity else cost >= 0


@pytest.mark.parametrize("picker", PICKERS)
@given(rows=backends, data=st.data())
def test_a_picker_chooses_among_those_offered_without_side_effects(picker: str, rows,
                                                                   data) -> None:
    part = registered("picker")[picker]
    assert part.name == picker and (part.__doc__ or "").strip()
    fleet = fleet_of(rows)
    offered = data.draw(st.lists(st.sampled_from(fleet.names), min_size=1, unique=True))
    candidates = [b for b in fleet if b.name in offered]
    p = part()
    chosen = p.pick(candidates, lambda b: float(b.outstanding_tokens), fleet)
    assert chosen in candidates
    assert p.pick(candidates, lambda b: float(b.outstanding_tokens), fleet) is chosen
    held = {b.name: Candidate(b.outstanding_tokens, b.inflight, float(b.outstanding_tokens),
                              -2.0 * data.draw(st.integers(0, 80)), b.index)
            for b in candidates}
    if len(held) >= 2:
        name, reason = p.weigh(chosen.name, held, len(HISTORY))
        assert name in held and reason in ("affinity", "load", "bounded")
    p.dispatched(chosen, fleet)


def routes() -> list[Routing]:
    return [Routing(picker=picker, scorers={scorer: 1.0}) for picker in PICKERS
            for scorer in SCORERS] + [Routing(picker=picker) for picker in PICKERS]


@pytest.mark.parametrize("routing", routes(), ids=lambda r: f"{r.picker}-{'+'.join(r.scorers)}")
@settings(max_examples=25, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["arrive", "dispatch", "end", "scrape"]),
                                 st.sampled_from(["a", "b", "i"]), st.integers(1, 4)),
                       max_size=40))
def test_every_route_sends_work_where_it_may_go_and_leaves_no_load(routing: Routing,
                                                                   events) -> None:
    config = make_config(routing=routing.model_dump(), backends=[
        {"url": f"http://127.0.0.1:{8001 + i}", "name": f"b{i}"} for i in range(3)])
    core = SchedulingCore(config)
    Route(routing)  # builds from the parts the configuration named
    inflight: list[QueuedRequest] = []
    now = 0.0
    for kind, tenant, k in events:
        now += 0.05
        if kind == "arrive":
            arrive(core, tenant, now, prompt_tokens=32 * k, max_tokens=8,
                   prefix=PromptPrefix(token_ids=HISTORY[:32 * k]), session=tenant)
        elif kind == "dispatch":
            for d in core.dispatch_ready(now):
                assert core.fleet[d.backend].takes_work
                inflight.append(d.request)
        elif kind == "scrape":
            for b in core.fleet:
                core.on_backend_metrics(b.name, BackendSample(
                    now, 0, b.inflight, 0.1, 0.0, kv_blocks=1000, block_size=BLOCK))
        elif inflight:
            done = inflight.pop(0)
            core.on_completed(done, done.prompt_tokens, 8, now, cached_tokens=0)
    for done in inflight:
        core.on_completed(done, done.prompt_tokens, 8, now, cached_tokens=0)
    core.fold_streamed()
    for b in core.fleet:
        assert b.outstanding_tokens == b.prefill_tokens == b.inflight == 0
