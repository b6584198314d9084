"""The routes: a picker over weighted scorers (sidecar.routing), as the presets of today's
routing names choose among a fleet's backends."""

from __future__ import annotations

import pytest

from tests.unit.sidecar.builders import make_fleet, make_request, send
from weighbridge.sidecar.config import Routing
from weighbridge.sidecar.fleet import Fleet
from weighbridge.sidecar.routing import Route


def pick(route: Route, fleet: Fleet, can_take: frozenset[str] | None = None) -> str:
    candidates = [b for b in fleet if b.takes_work and (can_take is None or b.name in can_take)]
    return route.pick(make_request(), candidates, fleet).name


def test_least_tokens_counts_prompt_until_first_token_then_remaining_output() -> None:
    fleet = make_fleet("a", "b")
    route = Route("least_tokens")
    send(fleet, "x", "a", 1000, 500)
    assert fleet["a"].outstanding_tokens == 1500
    assert pick(route, fleet) == "b"
    send(fleet, "y", "b", 100, 100)
    send(fleet, "z", "b", 100, 100)
    assert pick(route, fleet) == "b"  # 400 < 1500 although b runs two requests
    fleet.streamed("x", 0)  # first chunk: prefill done
    assert fleet["a"].outstanding_tokens == 500
    fleet.streamed("x", 600)  # beyond the estimate: never negative
    assert fleet["a"].outstanding_tokens == 0
    fleet.finished("x")
    assert fleet["a"].outstanding_tokens == 0
    fleet.finished("x")  # idempotent


def test_ties_break_on_kv_usage() -> None:
    fleet = make_fleet("a", "b")
    fleet["a"].kv_cache_usage = 0.9
    fleet["b"].kv_cache_usage = 0.2
    assert pick(Route("least_tokens"), fleet) == "b"
    assert pick(Route("prefix_aware"), fleet) == "b"


def test_round_robin_cycles_over_takers_and_advances_on_dispatch() -> None:
    fleet = make_fleet("a", "b", "c")
    route = Route("round_robin")
    seen = []
    for k in range(6):
        name = pick(route, fleet, frozenset({"a", "c"}))
        seen.append(name)
        send(fleet, str(k), name, 1, 1)
        route.dispatched(make_request(), fleet[name], fleet)
    assert seen == ["a", "c", "a", "c", "a", "c"]
    assert pick(route, fleet) == pick(route, fleet)  # pick alone has no side effect


def test_least_requests() -> None:
    fleet = make_fleet("a", "b")
    send(fleet, "1", "a", 1, 1)
    assert pick(Route("least_requests"), fleet) == "b"


def test_a_route_by_its_parts_is_the_preset_of_the_same_parts() -> None:
    fleet = make_fleet("a", "b", "c")
    send(fleet, "1", "a", 300, 10)
    send(fleet, "2", "b", 100, 10)
    parts = Routing(picker="least_loaded", scorers={"least_tokens": 1.0})
    assert pick(Route(parts), fleet) == pick(Route("least_tokens"), fleet) == "c"
    # Weights scale the scorers' costs; one scorer alone, any weight chooses alike.
    heavy = Routing(picker="least_loaded", scorers={"least_tokens": 3.0})
    assert pick(Route(heavy), fleet) == "c"


def test_an_unknown_part_is_refused() -> None:
    with pytest.raises(KeyError):
        Route("random")
    send(fleet := make_fleet("a"), "1", "a", 1, 1)
    with pytest.raises(ValueError):
        send(fleet, "1", "a", 1, 1)


def test_a_session_s_next_turn_goes_back_unless_another_is_far_less_loaded() -> None:
    """session_affinity: no prompt the sidecar can read, only the session header; the second
    turn goes back to the first turn's backend, though it carries a little more load."""
    fleet = make_fleet("a", "b")
    route = Route(Routing(picker="bounded_load",
                          scorers={"least_tokens": 1.0, "session_affinity": 1.0}))
    first = make_request(prompt=400, session="s")
    assert pick(route, fleet) == "a"
    route.dispatched(first, fleet["a"], fleet)
    send(fleet, "first", "a", 0, 300)  # its answer still streaming there
    second = make_request(prompt=500, session="s")
    chosen = route.pick(second, list(fleet), fleet).name
    assert chosen == "b"  # by load alone
    held = {b.name: route.held(second, b) for b in fleet}
    assert held["a"][0] == 500 and held["b"][0] == 0
    assert route.weigh(second, chosen, held, fleet) == ("a", "affinity")
    # Another session has nothing anywhere: load decides.
    other = make_request(prompt=500, session="t")
    assert route.weigh(other, "b", {b.name: route.held(other, b) for b in fleet},
                       fleet) == ("b", "load")


def test_a_session_binding_lasts_its_ttl_and_is_the_tenants_own() -> None:
    """session_affinity binds (tenant, session) for ``ttl_s`` after its last dispatch: one
    tenant's session id never steers another's, and an idle program is routed afresh."""
    fleet = make_fleet("a", "b")
    route = Route(Routing(picker="bounded_load",
                          scorers={"least_tokens": 1.0, "session_affinity": 1.0}))
    route.session_ttl(60.0)
    first = make_request("t1", prompt=400, session="s", dispatched_s=0.0)
    route.dispatched(first, fleet["a"], fleet)

    def held_on_a(tenant: str, at: float) -> int:
        call = make_request(tenant, prompt=500, session="s", dispatched_s=at)
        return route.held(call, fleet["a"])[0]

    assert held_on_a("t1", 60.0) == 500
    assert held_on_a("t1", 60.5) == 0  # past its TTL
    assert held_on_a("t2", 1.0) == 0  # another tenant's session of the same name
