"""Whether a backend's priority_scheduling agrees with its engine's policy
(sidecar.engine_policy): read from /server_info or from a refusal, said once."""

from __future__ import annotations

import orjson

from weighbridge.sidecar.engine_policy import (
    EnginePolicies,
    policy_of_server_info,
    refuses_priority,
)

# vLLM's V0 engine's refusal, as the emulator's --refuse-priority-under-fcfs answers it.
REFUSAL = orjson.dumps({"error": {"message": "Got priority 5 but Priority scheduling is not "
                                  "enabled.", "type": "BadRequestError", "param": None,
                                  "code": 400}})


def server_info(policy: object) -> bytes:
    return orjson.dumps({"vllm_config": {"scheduler_config": {"policy": policy}}})


def test_the_policy_is_read_from_server_info_and_nothing_else() -> None:
    assert policy_of_server_info(server_info("priority")) == "priority"
    assert policy_of_server_info(server_info("fcfs")) == "fcfs"
    assert policy_of_server_info(server_info("lifo")) is None
    assert policy_of_server_info(b"not json") is None
    assert policy_of_server_info(orjson.dumps({"vllm_config": "a text dump"})) is None


def test_a_refusal_is_a_400_that_says_so() -> None:
    assert refuses_priority(400, REFUSAL)
    assert not refuses_priority(200, REFUSAL)
    assert not refuses_priority(400, b'{"error": {"message": "max_tokens too large"}}')


def test_a_mismatch_is_said_once_per_backend_and_agreement_is_not() -> None:
    policies = EnginePolicies({"on": True, "off": False, "agrees": True})
    warning = policies.learned("on", "fcfs", "server_info")
    assert warning is not None and "backend on" in warning and "--scheduling-policy" in warning
    assert policies.learned("on", "fcfs", "server_info") is None  # said already
    warning = policies.learned("off", "priority", "server_info")
    assert warning is not None and "priority_scheduling: true" in warning
    assert policies.learned("agrees", "priority", "server_info") is None
    snapshot = policies.snapshot()
    assert snapshot["on"]["agrees"] is False and snapshot["agrees"]["agrees"] is True
    assert snapshot["off"] == {"configured": "fcfs", "engine": "priority",
                               "source": "server_info", "agrees": False, "refusals": 0}


def test_the_first_refusal_shows_an_fcfs_engine() -> None:
    policies = EnginePolicies({"b1": True})
    assert policies.answered("b1", 200, b"{}") is None
    warning = policies.answered("b1", 400, REFUSAL)
    assert warning is not None and "refusal" in warning
    assert policies.answered("b1", 400, REFUSAL) is None  # one line, not one per request
    assert policies.backends["b1"].refusals == 2 and policies.backends["b1"].mismatch


def test_a_reload_keeps_what_the_engines_showed() -> None:
    policies = EnginePolicies({"b1": True, "b2": False})
    policies.learned("b1", "fcfs", "server_info")
    policies.reconfigure({"b1": False})  # the flag fixed, b2 removed
    assert not policies.backends["b1"].mismatch and set(policies.backends) == {"b1"}
