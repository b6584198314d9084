"""The pure half of pod discovery (``weighbridge.sidecar.discovery``): which pods of an
InferencePool are endpoints, the members as list and watch events leave them, and the
configuration they make."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.config import Backend, Config
from weighbridge.sidecar.discovery import (
    PodEndpoint,
    PoolMembers,
    PoolSpec,
    pod_endpoints,
    with_endpoints,
)

POOL = {"spec": {"selector": {"matchLabels": {"app": "vllm"}},
                 "targetPorts": [{"number": 8000}]}}
SPEC = PoolSpec.of(POOL)


def pod(name: str, ip: str | None = "10.0.0.1", labels: dict[str, str] | None = None,
        ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {"app": "vllm"} if labels is None
                                else labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready",
                                              "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def test_the_pool_s_spec() -> None:
    assert PoolSpec((("app", "vllm"),), (8000,)) == SPEC
    assert SPEC.label_selector() == "app=vllm"
    two = PoolSpec.of({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                                "targetPorts": [{"number": 8000}, {"number": 8001}]}})
    assert two.label_selector() == "a=1,b=2" and two.target_ports == (8000, 8001)


@pytest.mark.parametrize("spec", [
    {}, {"selector": {}}, {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]},
    {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]},
    {"selector": {"matchLabels": {"a": "b"}}},
    {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]},
    {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": "80"}]},
    {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 80}, {}]},
])
def test_a_pool_without_labels_or_ports_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"selector|targetPorts"):
        PoolSpec.of({"spec": spec})


def test_a_ready_selected_pod_is_an_endpoint_per_port() -> None:
    assert pod_endpoints(pod("a"), SPEC) == (PodEndpoint("10.0.0.1", 8000, "a"),)
    two = PoolSpec((("app", "vllm"),), (8000, 8001))
    assert [e.name for e in pod_endpoints(pod("a"), two)] == ["10.0.0.1:8000", "10.0.0.1:8001"]
    six = pod_endpoints(pod("a", "fd00::1"), SPEC)[0]
    assert six.name == "[fd00::1]:8000" and six.url == "http://[fd00::1]:8000"


@pytest.mark.parametrize("kwargs", [
    {"ready": False}, {"deleting": True}, {"ip": None}, {"ip": "not-an-ip"},
    {"labels": {"app": "other"}}, {"labels": {}},
], ids=["unready", "deleting", "no-ip", "bad-ip", "other-app", "no-labels"])
def test_no_endpoint_unless_ready_selected_and_addressed(kwargs: dict[str, Any]) -> None:
    assert pod_endpoints(pod("a", **kwargs), SPEC) == ()


def test_a_pod_without_conditions_is_not_ready() -> None:
    assert pod_endpoints({"metadata": {"name": "a", "labels": {"app": "vllm"}},
                          "status": {"podIP": "10.0.0.1"}}, SPEC) == ()


# A pod's state as a watch may report it: its name, address, readiness and labels.
states = st.tuples(st.sampled_from(["p0", "p1", "p2"]),
                   st.sampled_from(["10.0.0.1", "10.0.0.2", None]), st.booleans(),
                   st.sampled_from(["vllm", "other"]))
events = st.lists(st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED"]), states),
                  max_size=30)


@given(st.lists(states, max_size=3, unique_by=lambda s: s[0]), events)
def test_the_members_are_the_last_word_on_each_pod(listed: list[Any], changes: list[Any]
                                                   ) -> None:
    """After a list and any watch events, the endpoints are exactly those of each pod's last
    reported state (a deleted pod's none)."""
    members = PoolMembers(SPEC)
    last: dict[str, dict[str, Any] | None] = {}
    members.listed(pod(n, ip, {"app": app}, ready) for n, ip, ready, app in listed)
    for n, ip, ready, app in listed:
        last[n] = pod(n, ip, {"app": app}, ready)
    for kind, (n, ip, ready, app) in changes:
        state = pod(n, ip, {"app": app}, ready)
        before = members.endpoints()
        changed = members.apply(kind, state)
        last[n] = None if kind == "DELETED" else state
        assert changed == (members.endpoints() != before)
    expected = sorted(e for state in last.values() if state is not None
                      for e in pod_endpoints(state, SPEC))
    assert list(members.endpoints()) == expected


def test_a_list_replaces_what_the_members_held() -> None:
    members = PoolMembers(SPEC)
    members.listed([pod("a", "10.0.0.1"), pod("b", "10.0.0.2")])
    members.listed([pod("b", "10.0.0.2")])
    assert [e.pod for e in members.endpoints()] == ["b"]


CONFIG = Config.model_validate({
    "tenants": {"t": {"tier": "standard", "api_keys": ["plain:sk-t"]}},
    "backends": [{"url": "http://template:8000", "priority_scheduling": True,
                  "stream_interval": 4}]})


def test_the_endpoints_take_the_template_s_settings() -> None:
    endpoints = [PodEndpoint("10.0.0.1", 8000, "a"), PodEndpoint("10.0.0.2", 8000, "b")]
    config = with_endpoints(CONFIG, endpoints, CONFIG.backends[0])
    assert [(b.name, b.url) for b in config.backends] == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000"), ("10.0.0.2:8000", "http://10.0.0.2:8000")]
    assert all(b.priority_scheduling and b.stream_interval == 4 for b in config.backends)
    assert config.tenants == CONFIG.tenants


def test_an_address_two_pods_claim_is_one_backend() -> None:
    """Two pods at one address (an IP given to a new pod before the old one's deletion is
    seen): one backend, whose name is unique as a configuration's must be."""
    endpoints = [PodEndpoint("10.0.0.1", 8000, "new"), PodEndpoint("10.0.0.1", 8000, "old")]
    assert [b.name for b in with_endpoints(CONFIG, endpoints, CONFIG.backends[0]).backends] \
        == ["10.0.0.1:8000"]


def test_no_endpoint_keeps_the_backends_in_force() -> None:
    """A configuration holds a backend; the picker refuses requests while none is ready."""
    assert with_endpoints(CONFIG, [], CONFIG.backends[0]) is CONFIG
    assert isinstance(CONFIG.backends[0], Backend)
