"""The replica wrapper (sidecar.replica): it reaches the scheduling core only through
``ReplicatedCore``, turns the core's record on when made, and gives and takes what the
shared state exchanges. Its effects on dispatch are in test_core_replicas.py and
test_prefix_replicas.py."""

from __future__ import annotations

from typing import Any

from tests.unit.sidecar.test_core import CHAT, arrive, make_config
from tests.unit.sidecar.test_core_pools import SERVED
from tests.unit.sidecar.test_prefix_routing import BLOCK, core_with
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.ratelimit import MONTH_S, Admit, StoredLevel
from weighbridge.sidecar.replica import Replica, ReplicatedCore, pool_id
from weighbridge.sidecar.request import QueuedRequest

POOL = "b1,b2"


def interface() -> set[str]:
    """The members ``ReplicatedCore`` declares."""
    return set(ReplicatedCore.__annotations__) | {
        name for name in vars(ReplicatedCore) if not name.startswith("_")}


class OnlyTheInterface:
    """A core seen through exactly ``ReplicatedCore``'s members: any other read or write
    raises, so a wrapper reaching past the interface fails here."""

    def __init__(self, core: SchedulingCore) -> None:
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_allowed", interface())

    def __getattr__(self, name: str) -> Any:
        if name not in self._allowed:
            raise AttributeError(f"the replica read {name!r}, outside ReplicatedCore")
        return getattr(self._core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._allowed:
            raise AttributeError(f"the replica wrote {name!r}, outside ReplicatedCore")
        setattr(self._core, name, value)


def test_the_interface_is_small() -> None:
    assert interface() == {"limit_table", "rate_limiter", "estimator", "request_model",
                           "record_for_replicas", "pools", "learn_sent_prefix",
                           "learn_sent_tokens", "learn_session"}


def test_every_call_of_the_wrapper_stays_inside_the_interface() -> None:
    core = core_with("prefix_aware")
    replica = Replica(OnlyTheInterface(core))  # type: ignore[arg-type]
    request = arrive(core, "a", prompt_tokens=400, admitted=Admit(500))
    assert isinstance(request, QueuedRequest)
    arrive(core, "b", prompt_tokens=400, prefix=PromptPrefix(token_ids=list(range(64))))
    assert replica.queued_flows() == [(POOL, "standard", "a"), (POOL, "standard", "b")]
    sent = list(core.dispatch_ready(0.0))
    assert len(sent) == 2
    assert replica.local_load() == {(POOL, "a"): (1, False), (POOL, "b"): (1, False)}
    assert replica.take_booked() == {(POOL, "standard", "a"): 0.5,
                                     (POOL, "standard", "b"): 0.5}
    core.on_completed(request, 400, 300, 0.0)
    assert replica.take_charges() == [(request, 200)]  # 700 against the 500 taken
    assert replica.take_observations() == [("a", CHAT, "", 300)]  # no model named
    replica.adopt_estimate("a", CHAT, 250.0)
    assert core.estimated_tokens("a", CHAT, 400, None) == 650
    replica.learn_outputs([("a", CHAT, "", 1000)])  # another replica's answer: the history
    assert core.estimator.final("a", CHAT, 300, None) == 1000
    assert replica.estimate_alpha == core.config.scheduler.output_estimate_alpha
    replica.charge_foreign(POOL, "standard", "b", 1.0)
    replica.set_foreign_load({(POOL, "b"): (2, True)})
    ((backend, block_size, blocks),) = replica.take_sent_prefixes()  # b's prompt
    assert backend == sent[1].backend and block_size == BLOCK
    replica.learn_sent_prefix("b1" if backend == "b2" else "b2", block_size, blocks)
    assert sorted(len(b.prefix) for b in core.fleet) == [len(blocks)] * 2
    assert sum(replica.take_sent_tokens().values()) == 800  # both prompts, prefix or not
    replica.learn_sent_tokens(backend, 100, 0.0)
    assert replica.buckets("a", CHAT, "standard", None)
    replica.use_local_limits(0.5, {}, 0.0)
    assert replica.take_local_charges() == {}
    assert replica.limit_table is core.limit_table


def test_the_record_starts_with_the_wrapper_and_covers_pools_made_later() -> None:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=4))
    arrive(core, "a", prompt_tokens=400)
    list(core.dispatch_ready(0.0))  # served before any replica: never booked
    replica = Replica(core)
    assert replica.take_booked() == {}
    for backend, models in SERVED.items():
        core.on_backend_models(backend, models)
    arrive(core, "a", prompt_tokens=400, model="qwen")  # a pool of its own, made now
    list(core.dispatch_ready(0.0))
    assert replica.take_booked() == {(pool_id(frozenset({"b2"})), "standard", "a"): 0.5}


def test_charges_are_what_the_shared_limits_are_owed() -> None:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=4))
    replica = Replica(core)
    queued = arrive(core, "a", prompt_tokens=400, admitted=Admit(500))
    assert isinstance(queued, QueuedRequest)
    assert core.cancel(queued.id, 0.0)
    exact = arrive(core, "a", prompt_tokens=400, admitted=Admit(500))
    local = arrive(core, "a", prompt_tokens=400)  # this process's own limiter took it
    (first, second) = core.dispatch_ready(0.0)
    core.on_completed(first.request, 400, 100, 0.0)  # as estimated: nothing owed
    core.on_completed(second.request, 400, 0, 0.0)
    assert {first.request.id, second.request.id} == {exact.id, local.id}
    assert replica.take_charges() == [(queued, -500)]  # the refund
    assert replica.take_charges() == []  # taken once


def test_local_limits_are_a_share_of_each_configured_limit() -> None:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=4))
    replica = Replica(core)
    (bucket,) = [b for b in replica.buckets("a", CHAT, "standard", None)
                 if b.name == "tokens_per_minute"]
    assert bucket.capacity == 100_000
    replica.use_local_limits(0.5, {}, 0.0)
    assert isinstance(core.rate_limiter.admit("a", CHAT, 40_000, 0.0, "standard", None), Admit)
    tokens = core.rate_limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]
    assert tokens["capacity"] == 50_000
    assert tokens["level"] == 10_000  # a minute bucket never read starts full


def test_local_limits_start_from_the_levels_last_read_and_owe_what_they_take() -> None:
    """An outage's buckets: a share of the level Redis last answered, a month never read
    empty, and what they charge is owed to the shared buckets afterwards."""
    config = make_config(tenants={
        name: {"tier": "standard", "api_keys": [f"plain:k{name}"],
               "limits": {"requests_per_month": 100}} for name in ("a", "b")})
    core = SchedulingCore(config, gate_limits=GateLimits(max_inflight=4))
    replica = Replica(core)
    read = StoredLevel(("tenant", "a"), "requests_per_month", 12.0, 1_000.0, 100.0,
                       100 / MONTH_S)
    replica.use_local_limits(0.5, {(read.scope, read.name): read}, 1_000.0)
    admitted = [core.rate_limiter.admit("a", CHAT, 10, 0.0, "standard", None)
                for _ in range(10)]
    assert sum(isinstance(r, Admit) for r in admitted) == 6  # 12 / 2, not 100 / 2
    assert not isinstance(core.rate_limiter.admit("b", CHAT, 10, 0.0, "standard", None),
                          Admit)  # never read: empty, not a full month
    replica.use_local_limits(1.0, {}, 1_000.0)  # N changed: the charges are kept
    assert replica.take_local_charges() == {(("tenant", "a"), "requests_per_month"): 6.0}
    assert replica.take_local_charges() == {}


def test_foreign_load_replaces_the_last_and_names_pools_by_their_backends() -> None:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=4))
    replica = Replica(core)
    assert pool_id(frozenset({"b2", "b1"})) == POOL
    replica.set_foreign_load({(POOL, "b"): (2, True), ("elsewhere", "a"): (1, True)})
    (pool,) = core.pools()
    assert pool.foreign == {"b": (2, True)}  # a pool this replica has not: dropped
    replica.set_foreign_load({})
    assert pool.foreign == {}
