"""sidecar.reload and SchedulingCore.reconfigure: what a reload may change, what carries
over where identity is unchanged, and that every request still ends exactly once."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.keys import hash_api_key
from weighbridge.sidecar.config import Config, ConfigError, parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.ratelimit import LimitTable, TenantRateLimiter
from weighbridge.sidecar.rejection import TENANT_REMOVED
from weighbridge.sidecar.reload import ConfigHolder, ReloadRefused, config_version, plan
from weighbridge.sidecar.request import QueuedRequest, RequestState
from weighbridge.vllm_metrics import BackendSample

CHAT = "/v1/chat/completions"
_ids = itertools.count()


def base() -> dict[str, Any]:
    return {
        "tenants": {
            "a": {"tier": "standard", "api_keys": ["plain:ka"],
                  "limits": {"tokens_per_minute": 10_000}},
            "b": {"tier": "standard", "api_keys": ["plain:kb"], "weight": 2.0},
        },
        "endpoints": {CHAT: {"quantum": 1000, "initial_output_estimate": 100}},
        "backends": [{"url": "http://127.0.0.1:8001", "name": "b1"}],
        "admission": {"max_inflight_per_backend": 2, "max_backend_waiting": 1},
    }


def config(data: dict[str, Any]) -> Config:
    return parse_config(data)


def changed(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``data`` with the dotted ``path`` set to ``value`` (None: deleted)."""
    out = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        del node[last]
    else:
        node[last] = value
    return out


def arrive(core: SchedulingCore, tenant: str, now: float = 0.0,
           prompt: int = 100) -> QueuedRequest:
    result = core.arrive(request_id=f"r{next(_ids)}", tenant=tenant,
                         tier=core.config.tenants[tenant].tier, endpoint=CHAT,
                         prompt_tokens=prompt, max_tokens=100, now=now)
    assert isinstance(result, QueuedRequest), result
    return result


def balanced(core: SchedulingCore) -> None:
    total = core.ledger.total()
    assert total.balanced
    queued = sum(p.scheduler.queued_requests for p in core._pools.values())
    inflight = sum(p.scheduler.inflight_requests for p in core._pools.values())
    assert (total.queued, total.dispatched) == (queued, inflight)


# ----------------------------------------------------------------------------- the plan


def test_a_config_reloaded_onto_itself_changes_nothing() -> None:
    old = config(base())
    result = plan(old, config(base()))
    assert not result.changes and result.summary() == "no change"
    assert config_version(old) == config_version(config(base()))


def test_the_version_reads_keys_as_digests_and_ignores_the_layout() -> None:
    hashed = changed(base(), "tenants.a.api_keys", [hash_api_key("ka")])
    assert config_version(config(hashed)) == config_version(config(base()))
    assert config_version(config(changed(base(), "tenants.a.weight", 3.0))) != \
        config_version(config(base()))


def test_the_plan_names_every_change_by_name_never_by_key() -> None:
    new = changed(base(), "tenants.c", {"tier": "batch", "api_keys": ["plain:kc"]})
    new = changed(new, "tenants.b", None)
    new = changed(new, "tenants.a.api_keys", ["plain:ka2"])
    new = changed(new, "tenants.a.limits", {"tokens_per_minute": 20_000})
    new["backends"] = [{"url": "http://127.0.0.1:8002", "name": "b2"}]
    new["admin_api_keys"] = ["plain:admin"]
    result = plan(config(base()), config(new))
    assert result.as_dict() == {
        "tenants_added": ["c"], "tenants_removed": ["b"], "tenants_changed": ["a"],
        "keys_changed": ["a"], "admin_keys_changed": True, "backends_added": ["b2"],
        "backends_removed": ["b1"], "other": [], "version": config_version(config(new))}
    assert "ka2" not in result.summary() and "admin" in result.summary()


@pytest.mark.parametrize(("path", "value", "where"), [
    ("scheduler", {"policy": "fcfs"}, "scheduler"),
    ("routing", "round_robin", "routing"),
    ("admission.max_inflight_per_backend", 3, "admission"),
    ("max_body_bytes", 1000, "max_body_bytes"),
    ("state", {"backend": "redis", "url": "redis://127.0.0.1:1/0"}, "state"),
    ("tiers.standard.rank", 7, "tiers.standard.rank"),
    (f"endpoints.{CHAT}.quantum", 10, f"endpoints.{CHAT}"),
])
def test_what_needs_a_restart_is_refused_at_its_dotted_path(path: str, value: Any,
                                                            where: str) -> None:
    if path.startswith("tiers."):
        new = {**base(), "tiers": {"interactive": {"rank": 1}, "standard": {"rank": 2},
                                   "batch": {"rank": 3}}}
        new = changed(new, path, value)
        old = config({**base(), "tiers": {"interactive": {"rank": 1}, "standard": {"rank": 2},
                                          "batch": {"rank": 3}}})
    else:
        new, old = changed(base(), path, value), config(base())
    with pytest.raises(ReloadRefused) as refused:
        plan(old, config(new))
    assert [p for p, _ in refused.value.errors] == [where]


def test_rate_limits_of_tiers_endpoints_and_models_reload() -> None:
    new = changed(base(), f"endpoints.{CHAT}.tenant_limits", {"requests_per_minute": 5})
    new = changed(new, "tiers", {"interactive": {"rank": 1}, "standard": {"rank": 2,
                  "limits": {"tokens_per_day": 10}}, "batch": {"rank": 3}})
    old = changed(base(), "tiers", {"interactive": {"rank": 1}, "standard": {"rank": 2},
                                    "batch": {"rank": 3}})
    assert plan(config(old), config(new)).other == ("tiers.standard", f"endpoints.{CHAT}")


def test_a_kept_backend_may_not_change_and_a_draining_name_may_not_return() -> None:
    moved = changed(base(), "backends", [{"url": "http://127.0.0.1:9999", "name": "b1"}])
    with pytest.raises(ReloadRefused) as refused:
        plan(config(base()), config(moved))
    assert [p for p, _ in refused.value.errors] == ["backends.0"]
    back = changed(base(), "backends", [{"url": "http://127.0.0.1:8001", "name": "b1"},
                                        {"url": "http://127.0.0.1:8003", "name": "old"}])
    with pytest.raises(ReloadRefused) as refused:
        plan(config(base()), config(back), draining={"old"})
    assert [p for p, _ in refused.value.errors] == ["backends.1.name"]


def test_the_holder_keeps_the_config_in_force_when_the_file_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(base()))
    holder = ConfigHolder(config(base()), str(path))
    version = holder.version
    path.write_text(yaml.safe_dump(changed(base(), "tenants.a.weight", -1)))
    with pytest.raises(ConfigError) as invalid:
        holder.check()
    assert [p for p, _ in invalid.value.errors] == ["tenants.a.weight"]
    assert holder.version == version and holder.reloads == {"ok": 0, "refused": 1}
    assert "tenants.a.weight" in (holder.last_error or "")
    path.write_text(yaml.safe_dump(changed(base(), "tenants.a.weight", 3.0)))
    new, result = holder.check()
    assert result.tenants_changed == ("a",)
    holder.adopt(new, result.version)
    assert holder.version == config_version(new) != version
    assert holder.reloads == {"ok": 1, "refused": 1}


# ----------------------------------------------------------------------------- buckets


def test_a_bucket_keeps_what_was_spent_when_its_limit_changes() -> None:
    limits = config(base()).tenants["a"].limits
    limiter = TenantRateLimiter(LimitTable({"a": limits}))
    limiter.admit("a", CHAT, 6_000, 0.0)
    raised = config(changed(base(), "tenants.a.limits", {"tokens_per_minute": 20_000}))
    limiter.retable(LimitTable({"a": raised.tenants["a"].limits}), 0.0)
    bucket = limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]
    assert (bucket["capacity"], bucket["level"]) == (20_000, 14_000)
    lowered = config(changed(base(), "tenants.a.limits", {"tokens_per_minute": 5_000}))
    limiter.retable(LimitTable({"a": lowered.tenants["a"].limits}), 0.0)
    bucket = limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]
    assert bucket["level"] == -1_000  # spent beyond the new limit: a debt to wait out
    limiter.retable(LimitTable({}), 0.0)
    assert limiter.snapshot(0.0)["tenants"] == {}


# ----------------------------------------------------------------------------- the core


def test_a_removed_tenants_queue_is_answered_and_its_streams_finish() -> None:
    core = SchedulingCore(config(base()))
    core.mark_backend_healthy("b1")
    running = arrive(core, "b")
    assert [d.request for d in core.dispatch_ready(0.0)] == [running]
    waiting = [arrive(core, "b") for _ in range(3)]
    kept = arrive(core, "a")
    evicted = core.reconfigure(config(changed(base(), "tenants.b", None)), 1.0)
    assert evicted == waiting
    assert all(r.state is RequestState.ENDED for r in waiting)
    tally = core.ledger.by_tenant()["b"]
    assert tally.rejected == {TENANT_REMOVED: 3} and tally.dispatched == 1
    balanced(core)
    core.on_first_token(running, 1.0)
    core.on_completed(running, 100, 100, 2.0)  # admitted under the old terms, finishes
    assert core.ledger.by_tenant()["b"].completed == 1
    assert "b" not in core.scheduler._tenants  # forgotten once nothing is in flight
    assert [d.request for d in core.dispatch_ready(2.0)] == [kept]
    balanced(core)


def test_drr_credit_and_queues_carry_over_and_a_new_weight_counts_at_once() -> None:
    core = SchedulingCore(config(base()))
    core.mark_backend_healthy("b1")
    for _ in range(4):
        arrive(core, "a", prompt=900)
        arrive(core, "b", prompt=900)
    list(core.dispatch_ready(0.0))
    before = {t.tenant: t.deficit_quanta for t in core.stats(0.0).tenants}
    queued = core.scheduler.queued_requests
    core.reconfigure(config(changed(base(), "tenants.b.weight", 5.0)), 0.0)
    after = {t.tenant: (t.deficit_quanta, t.weight) for t in core.stats(0.0).tenants}
    assert after == {"a": (before["a"], 1.0), "b": (before["b"], 5.0)}
    assert core.scheduler.queued_requests == queued
    snapshot = core.scheduler.snapshot()
    assert snapshot["tiers"]["standard"]["backlogged_weight"] == 6.0
    assert snapshot["active_weight"] == 6.0


def test_an_added_tenant_and_key_serve_from_the_next_decision() -> None:
    core = SchedulingCore(config(base()))
    core.mark_backend_healthy("b1")
    new = config(changed(base(), "tenants.c", {"tier": "batch", "api_keys": ["plain:kc"]}))
    core.reconfigure(new, 0.0)
    request = arrive(core, "c")
    assert [d.request for d in core.dispatch_ready(0.0)] == [request]


def test_an_added_backend_takes_work_once_healthy_and_a_removed_one_drains() -> None:
    core = SchedulingCore(config(base()))
    core.mark_backend_healthy("b1")
    first = arrive(core, "a")
    assert [d.backend for d in core.dispatch_ready(0.0)] == ["b1"]
    both = changed(base(), "backends", [{"url": "http://127.0.0.1:8001", "name": "b1"},
                                        {"url": "http://127.0.0.1:8002", "name": "b2"}])
    core.reconfigure(config(both), 0.0)
    assert core.has_backend("b2") and not core.fleet["b2"].takes_work
    core.mark_backend_healthy("b2")
    second = arrive(core, "a")
    assert [d.backend for d in core.dispatch_ready(0.0)] == ["b2"]  # b1 holds more
    only_b2 = changed(base(), "backends", [{"url": "http://127.0.0.1:8002", "name": "b2"}])
    core.reconfigure(config(only_b2), 0.0)
    assert core.draining == {"b1"} and core.has_backend("b1")
    third = arrive(core, "a")
    assert [d.backend for d in core.dispatch_ready(0.0)] == ["b2"]
    core.on_completed(first, 100, 100, 1.0)  # b1's last request: b1 is forgotten
    assert not core.has_backend("b1") and core.draining == set()
    for request in (second, third):
        core.on_completed(request, 100, 100, 1.0)
    balanced(core)
    assert core.ledger.total().completed == 3


def test_a_kept_backend_keeps_its_gate_and_learned_shape() -> None:
    core = SchedulingCore(config(base()))
    for at in (0.0, 1.0, 2.0):  # the engine saturated: its slots are learned
        core.on_backend_metrics("b1", BackendSample(at, waiting=3, running=4,
                                                    generation_tokens_total=100 * at))
    gate, shape = core.fleet["b1"].gate, core.fleet["b1"].gate.shape
    both = changed(base(), "backends", [{"url": "http://127.0.0.1:8001", "name": "b1"},
                                        {"url": "http://127.0.0.1:8002", "name": "b2"}])
    core.reconfigure(config(changed(both, "tenants.a.weight", 2.0)), 3.0)
    assert core.fleet["b1"].gate is gate and gate.shape == shape
    assert core.fleet["b2"].gate.shape != shape  # the added one learns its own


# ----------------------------------------------------------------------------- properties


_TENANTS = ("a", "b", "c", "d")
_BACKENDS = ("b1", "b2", "b3")


def _fleet(tenants: frozenset[str], backends: frozenset[str], weight: float) -> Config:
    return config({
        "tenants": {name: {"tier": "standard", "api_keys": [f"plain:k{name}"],
                           "weight": weight if name == "a" else 1.0,
                           "limits": {"tokens_per_minute": 50_000}}
                    for name in sorted(tenants)},
        "endpoints": {CHAT: {"quantum": 1000, "initial_output_estimate": 100}},
        "backends": [{"url": f"http://127.0.0.1:{8000 + i}", "name": name}
                     for i, name in enumerate(_BACKENDS) if name in backends],
        "admission": {"max_inflight_per_backend": 2, "max_backend_waiting": 1},
    })


_events = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(_TENANTS)),
    st.tuples(st.just("dispatch"), st.none()),
    st.tuples(st.just("end"), st.integers(0, 7)),
    st.tuples(st.just("reload"), st.tuples(
        st.frozensets(st.sampled_from(_TENANTS), min_size=1),
        st.frozensets(st.sampled_from(_BACKENDS), min_size=1),
        st.sampled_from((1.0, 3.0))))), max_size=60)


@given(_events)
def test_every_request_ends_exactly_once_across_any_reloads(events: list[Any]) -> None:
    """Random arrivals, dispatches, ends and reloads (tenants and backends added and
    removed, a weight changed): the ledger balances after every step, every request
    arrived ends exactly once, a removed tenant's queued requests end tenant_removed, and
    no request is dispatched to a backend that is draining or not yet healthy."""
    current = _fleet(frozenset(_TENANTS), frozenset(_BACKENDS), 1.0)
    core = SchedulingCore(current)
    for name in _BACKENDS:
        core.mark_backend_healthy(name)
    inflight: list[QueuedRequest] = []
    arrived: list[QueuedRequest] = []
    attempted = 0
    now = 0.0
    for kind, arg in events:
        now += 0.1
        if kind == "arrive" and arg in core.config.tenants:
            attempted += 1
            result = core.arrive(request_id=f"r{next(_ids)}", tenant=arg, tier="standard",
                                 endpoint=CHAT, prompt_tokens=200, max_tokens=100, now=now)
            if isinstance(result, QueuedRequest):
                arrived.append(result)
        elif kind == "dispatch":
            for d in core.dispatch_ready(now):
                assert d.backend not in core.draining
                assert d.backend in {b.name for b in core.config.backends}
                inflight.append(d.request)
        elif kind == "end" and inflight:
            request = inflight.pop(arg % len(inflight))
            core.on_completed(request, 200, 50, now)
        elif kind == "reload":
            tenants, backends, weight = arg
            new = _fleet(tenants, backends, weight)
            try:
                plan(core.config, new, core.draining)
            except ReloadRefused:
                continue  # a draining name back too soon: refused, nothing changes
            removed = set(core.config.tenants) - tenants
            evicted = core.reconfigure(new, now)
            assert {r.tenant for r in evicted} <= removed
            for name in backends:
                core.mark_backend_healthy(name)  # probed (the shell's part)
        balanced(core)
    for request in inflight:
        core.on_completed(request, 200, 50, now)
    for request in arrived:
        if request.state is RequestState.QUEUED:
            assert core.cancel(request.id, now)
    balanced(core)
    total = core.ledger.total()
    assert total.queued == total.dispatched == 0
    assert total.arrivals == attempted
    assert all(r.state is RequestState.ENDED for r in arrived)
    assert core.draining == set()
    assert set(core.fleet.names) == {b.name for b in core.config.backends}
