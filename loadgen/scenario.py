"""Scenarios: a named sequence of phases and a tenants file, resolved into a workload.

A scenario module in ``scenarios/`` defines ``SCENARIO = Scenario(...)`` and nothing Locust
would pick up (no User or LoadTestShape classes): the one locustfile there discovers every
scenario with :func:`discover_scenarios` and runs the one named by ``--scenario``, so Locust
never has to choose between several shapes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from weighbridge.loadgen.tenants import ENDPOINT_PATHS, TenantSpec, load_tenants
from weighbridge.rundir import PhaseInfo, TenantInfo

__all__ = ["Phase", "PhaseSpan", "Scenario", "ScenarioError", "Workload", "discover_scenarios",
           "load_scenario"]


class ScenarioError(ValueError):
    """A scenario that cannot run as asked (unknown name, bad options, bad tenants)."""


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float | None  # None: until the run is stopped (only the last phase)

    def __post_init__(self) -> None:
        if self.duration_s is not None and not self.duration_s > 0:
            raise ScenarioError(f"phase {self.name!r}: duration_s must be > 0")


@dataclass(frozen=True, slots=True)
class PhaseSpan:
    name: str
    start_s: float
    end_s: float  # math.inf for an open-ended last phase


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    phases: tuple[Phase, ...]
    tenants_file: Path  # relative paths are relative to the scenario's module
    notes: str = ""  # how to scale it up, what to look at
    # The tenant whose latency the scenario is about (run.json options.victim, which the
    # report's isolation section reads); None, or a name the tenants file lacks: none.
    victim: str | None = None

    def __post_init__(self) -> None:
        if not self.phases:
            raise ScenarioError(f"scenario {self.name!r}: needs at least one phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ScenarioError(f"scenario {self.name!r}: phase names must be unique")
        if any(p.duration_s is None for p in self.phases[:-1]):
            raise ScenarioError(f"scenario {self.name!r}: only the last phase may be open-ended")

    def workload(self, *, tenants_file: Path | None = None, scale: float = 1.0,
                 stretch: float = 1.0) -> Workload:
        """The runnable workload: phases stretched by ``stretch``, every tenant's load
        (rates, burst sizes, closed-loop users) multiplied by ``scale``."""
        if not scale > 0:
            raise ScenarioError(f"--scale must be > 0, got {scale}")
        if not stretch > 0:
            raise ScenarioError(f"--stretch must be > 0, got {stretch}")
        tenants = load_tenants(tenants_file or self.tenants_file)
        tenants.check_phases([p.name for p in self.phases])
        spans, t = [], 0.0
        for phase in self.phases:
            end = math.inf if phase.duration_s is None else t + phase.duration_s * stretch
            spans.append(PhaseSpan(phase.name, t, end))
            t = end
        names = {t.name for t in tenants.tenants}
        return Workload(
            scenario=self.name,
            phases=tuple(spans),
            tenants=tuple(t.scaled(scale) for t in tenants.tenants),
            victim=self.victim if self.victim in names else None,
        )


@dataclass(frozen=True, slots=True)
class Workload:
    scenario: str
    phases: tuple[PhaseSpan, ...]
    tenants: tuple[TenantSpec, ...] = field(default=())
    victim: str | None = None

    @property
    def end_s(self) -> float:
        """When the last phase ends (math.inf when it is open-ended)."""
        return self.phases[-1].end_s

    def phase_infos(self, run_end_s: float) -> list[PhaseInfo]:
        """The phases as run.json has them, cut at the run's end."""
        return [
            PhaseInfo(name=p.name, start_s=p.start_s, end_s=min(p.end_s, run_end_s))
            for p in self.phases
            if p.start_s < run_end_s
        ]

    def tenant_infos(self) -> list[TenantInfo]:
        return [TenantInfo(name=t.name, tier=t.tier, weight=t.weight,
                           endpoint=ENDPOINT_PATHS[t.endpoint]) for t in self.tenants]


def _load_module_scenario(path: Path) -> Scenario | None:
    # A private module name: Locust imports the same file as a top-level module of its own.
    spec = importlib.util.spec_from_file_location(f"_weighbridge_scenario_{path.stem}", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scenario = getattr(module, "SCENARIO", None)
    if scenario is None:
        return None
    if not isinstance(scenario, Scenario):
        raise ScenarioError(f"{path}: SCENARIO is a {type(scenario).__name__}, not a Scenario")
    tenants_file = scenario.tenants_file
    if not tenants_file.is_absolute():
        tenants_file = path.parent / tenants_file
    return dataclasses.replace(scenario, tenants_file=tenants_file)


def load_scenario(path: Path) -> Scenario:
    """The ``SCENARIO`` a scenario file defines (its tenants file resolved next to it)."""
    scenario = _load_module_scenario(path)
    if scenario is None:
        raise ScenarioError(f"{path}: defines no SCENARIO")
    return scenario


def discover_scenarios(directory: Path, exclude: Sequence[Path] = ()) -> dict[str, Scenario]:
    """Every ``SCENARIO`` defined by a ``*.py`` file directly in ``directory`` (files
    starting with ``_`` and those in ``exclude``, such as the locustfile, are skipped)."""
    skip = {p.resolve() for p in exclude}
    found: dict[str, Scenario] = {}
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_") or path.resolve() in skip:
            continue
        scenario = _load_module_scenario(path)
        if scenario is None:
            continue
        if scenario.name in found:
            raise ScenarioError(f"{path}: scenario name {scenario.name!r} is defined twice")
        found[scenario.name] = scenario
    return found

