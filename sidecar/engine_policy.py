"""Whether each backend's ``priority_scheduling`` agrees with the policy its engine runs
(vLLM's ``--scheduling-policy``): a disagreement either way fails a tier, and it says so.

* Flag off in front of a priority engine: every request goes with priority 0, so tiers and
  over-share demotion never reach the engine's queue.
* Flag on in front of an fcfs engine: the engine ignores the priorities (vLLM's V1 engine) or
  refuses every request that has one (vLLM's V0 engine, and the emulator when told to:
  ``--refuse-priority-under-fcfs``), and tiers then wait in arrival order or fail.

What the engine runs is learned from what it shows: its ``/server_info`` at start-up (served
by vLLM with ``VLLM_SERVER_DEV_MODE=1``, and by the emulator likewise), or the first answer
that refuses a priority. A mismatch is said once per backend, in one log line, on the
``weighbridge_backend_policy_mismatch`` gauge and in ``/admin/state``. Pure: the shell
(sidecar.app) reads the engines and passes what they said.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["EnginePolicies", "EnginePolicy", "EnginePolicyCollector", "policy_of_server_info",
           "refuses_priority"]

Policy = Literal["fcfs", "priority"]


def policy_of_server_info(body: bytes) -> Policy | None:
    """The scheduling policy in vLLM's ``/server_info?config_format=json`` answer (its
    ``vllm_config.scheduler_config.policy``); None for anything else."""
    try:
        info = orjson.loads(body)
        policy = info["vllm_config"]["scheduler_config"]["policy"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return policy if policy in ("fcfs", "priority") else None


def refuses_priority(status: int, body: bytes) -> bool:
    """Whether an engine's answer refuses a request for its priority: vLLM's "Got priority
    N but Priority scheduling is not enabled." as a 400 (an engine's text, never a client's)."""
    return status == 400 and b"priority scheduling is not enabled" in body[:4096].lower()


@dataclass(slots=True)
class EnginePolicy:
    configured: Policy  # what the backend's priority_scheduling says
    engine: Policy | None = None  # what the engine showed it runs; None: not shown yet
    source: str | None = None  # how it showed it: "server_info" or "refusal"
    refusals: int = 0  # answers that refused a priority

    @property
    def mismatch(self) -> bool:
        return self.engine is not None and self.engine != self.configured

    def snapshot(self) -> dict[str, Any]:
        return {"configured": self.configured, "engine": self.engine, "source": self.source,
                "agrees": None if self.engine is None else not self.mismatch,
                "refusals": self.refusals}


def _warning(backend: str, policy: EnginePolicy) -> str:
    if policy.configured == "priority":
        consequence = ("the tiers' and over-share demotion's priorities are refused or "
                       "ignored there: set priority_scheduling: false, or start the engine "
                       "with --scheduling-policy priority")
    else:
        consequence = ("every request goes there with priority 0, so tiers and over-share "
                       "demotion never reach its queue: set priority_scheduling: true")
    return (f"backend {backend}: priority_scheduling says {policy.configured}, but its engine "
            f"runs {policy.engine} (seen in its {policy.source}): {consequence}")


class EnginePolicies:
    """Every backend's configured policy beside what its engine showed."""

    def __init__(self, configured: Mapping[str, bool]) -> None:
        self.backends: dict[str, EnginePolicy] = {}
        self.reconfigure(configured)

    def reconfigure(self, configured: Mapping[str, bool]) -> None:
        """A reload's backends: what each engine showed is kept."""
        old = self.backends
        self.backends = {}
        for name, priority in configured.items():
            policy = old.get(name) or EnginePolicy("fcfs")
            policy.configured = "priority" if priority else "fcfs"
            self.backends[name] = policy

    def learned(self, backend: str, engine: Policy, source: str) -> str | None:
        """The engine showed its policy; the warning to log when this newly shows a
        mismatch (once per backend and policy), else None."""
        policy = self.backends.get(backend)
        if policy is None:
            return None
        was = policy.mismatch, policy.engine
        policy.engine, policy.source = engine, source
        if policy.mismatch and was != (True, engine):
            return _warning(backend, policy)
        return None

    def answered(self, backend: str, status: int, body: bytes) -> str | None:
        """An engine's answer to a request sent with a non-zero priority: a refusal shows
        the engine runs fcfs (the warning, the first time)."""
        if not refuses_priority(status, body):
            return None
        policy = self.backends.get(backend)
        if policy is None:
            return None
        policy.refusals += 1
        return self.learned(backend, "fcfs", "refusal")

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: policy.snapshot() for name, policy in self.backends.items()}


class EnginePolicyCollector:
    """Each backend's agreement on /metrics."""

    def __init__(self, policies: EnginePolicies) -> None:
        self.policies = policies

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        mismatch = GaugeMetricFamily(
            "weighbridge_backend_policy_mismatch",
            "1 while the backend's priority_scheduling disagrees with the scheduling policy "
            "its engine showed (its /server_info, or an answer refusing a priority).",
            labels=["backend"])
        refusals = CounterMetricFamily(
            "weighbridge_backend_priority_refusals",
            "Answers in which the backend's engine refused a request for its priority.",
            labels=["backend"])
        for name, policy in self.policies.backends.items():
            mismatch.add_metric([name], 1 if policy.mismatch else 0)
            refusals.add_metric([name], policy.refusals)
        yield from (mismatch, refusals)
