"""One isolation point in virtual time: the victim's TTFT beside a flood through the sidecar
with its defaults, against the ideal bound on the same engine (docs/sidecar.md's matrix).

A point is an engine shape (slots, step budget, KV ample or tight, fcfs or priority
scheduling), where the victim sits (in the flood's tier with its weight, or in a higher
tier), the flood's request size and the number of engines of that shape (a fleet: the
victim and the flood are that many times one engine's, so each engine is loaded as a lone
one). Two arms run on the same step model:

``defaults``  the whole sidecar core (``Simulation``) with a config naming only tiers,
              tenants and the backends, in front of one ``SimEngine`` per engine. The flood
              is a closed loop of ``FLOOD_USERS_PER_SLOT`` x the engines' slots users, so it
              is backlogged at the sidecar for the whole run; the victim is Poisson.
``ideal``     ``weighbridge.app.simulation.ideal.ideal_run`` unpaced: the flood limits itself to
              ``cap`` closed-loop streams sent straight to the engine, where ``cap`` is what
              fits in the engine with room for the victim (see :func:`ideal_cap`); the
              victim goes straight to the engine too (on a fleet: one engine's bound, its
              output times the engines). On a priority engine the victim is
              sent at priority 0 and the flood at 1, which is what the defaults send there
              (the flood over its share is demoted by ``over_share_priority_demotion``);
              fcfs ignores priorities.
``paced``     context, not the bound: the same cap with the flood's prompts admitted one at
              a time (``ideal_run``'s zero-overhead sidecar).

Why this ideal: it is the live isolation benchmark's (``benchmarks/isolation.py``),
and it needs no sidecar at all: a flood that limits itself to what the engine holds is what
the sidecar's defaults must be no worse than. It is not a lower bound everywhere: where the
flood's streams end and restart faster than the step budget prefills them (many slots, a
small budget) the engine's own waiting queue holds flood prompts ahead of the victim, and a
sidecar that paces the prompts does better; ``paced`` shows by how much.

Per arm: the victim's TTFT p50/p90/p99 over the requests it sends in the measurement window
``[warmup_s, warmup_s + window_s)`` and the engines' generated tokens per second over the
same window (the tokens of their steps ending in it, ``WindowEngine``). The
defaults arm runs ``tail_s`` beyond the window so that the window's last victim requests
can be answered; one still unanswered then counts as an infinite TTFT.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.ideal import IdealPoint, IdealShape, ideal_run
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.engine import Coast, StepResult
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Closed, Poisson
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.statistics import percentile

__all__ = ["FLOODS", "ArmFigures", "IsolationPoint", "PointResult", "WindowEngine",
           "ideal_cap", "run_defaults", "run_ideal", "run_point"]

Kv = Literal["ample", "tight"]
EngineScheduling = Literal["fcfs", "priority"]
VictimTier = Literal["same", "higher"]
FloodSize = Literal["short", "long"]

FLOODS: dict[str, tuple[int, int]] = {"short": (64, 32), "long": (512, 192)}  # prompt, output
VICTIM = (64, 16)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024  # the longest request (704 tokens) fits; the smallest KV (1,152) holds it
# KV in flood sequences at full length per engine slot: ample holds twice the slots' worth
# of the flood; tight holds fewer than the slots (benchmarks/isolation.py's 26 of 32).
KV_SEQS_PER_SLOT: dict[str, float] = {"ample": 2.0, "tight": 0.8}
VICTIM_ROOM_SEQS = 2  # the ideal flood leaves this many flood-sized sequences free
FLOOD_USERS_PER_SLOT = 3  # the flood's closed-loop users per engine slot (defaults arm)
VICTIM_KEY, FLOOD_KEY = "sk-victim", "sk-flood"


@dataclass(frozen=True, slots=True)
class IsolationPoint:
    slots: int  # max_num_seqs
    budget: int  # max_num_batched_tokens
    kv: Kv
    policy: EngineScheduling
    victim_tier: VictimTier  # same: the flood's tier and weight; higher: a lower rank
    flood: FloodSize
    # Engines of this shape behind the sidecar: the victim and the flood are this many
    # times one engine's, so each engine is loaded as a lone one is.
    engines: int = 1
    profile: str = "h100-llama3-8b"
    victim_rate: float = 4.0  # requests/s per engine, Poisson

    @property
    def label(self) -> str:
        fleet = f" engines={self.engines}" if self.engines > 1 else ""
        return (f"seqs={self.slots} budget={self.budget} kv={self.kv} {self.policy} "
                f"victim={self.victim_tier} flood={self.flood}{fleet}")

    @property
    def victim_tier_name(self) -> str:
        return "first" if self.victim_tier == "higher" else "shared"

    @property
    def flood_lengths(self) -> tuple[int, int]:
        return FLOODS[self.flood]

    @property
    def flood_blocks(self) -> int:
        """KV blocks one flood sequence holds at full length."""
        return math.ceil(sum(self.flood_lengths) / BLOCK_SIZE)

    @property
    def kv_blocks(self) -> int:
        seqs = math.floor(KV_SEQS_PER_SLOT[self.kv] * self.slots)
        return seqs * self.flood_blocks

    def engine(self) -> EmulatorOptions:
        return EmulatorOptions(profile=self.profile, max_num_seqs=self.slots,
                               max_num_batched_tokens=self.budget,
                               num_kv_blocks=self.kv_blocks, block_size=BLOCK_SIZE,
                               max_model_len=MAX_MODEL_LEN,
                               scheduling_policy=self.policy)


def ideal_cap(point: IsolationPoint) -> int:
    """The flood streams of the ideal: as many as the engine holds (its slots, or the flood
    sequences its KV holds at full length, whichever binds) less room for the victim
    (``VICTIM_ROOM_SEQS``: at 4 requests/s of ~0.1 s each the victim rarely has more than
    two in flight)."""
    fits = min(point.slots, point.kv_blocks // point.flood_blocks)
    return max(1, fits - VICTIM_ROOM_SEQS)


def plain_config(point: IsolationPoint, admission: Mapping[str, object] | None = None
                 ) -> Config:
    """Tiers, tenants and the backends only (no SLO, so nothing is turned away early); a
    backend says whether it schedules by priority, a fact about the engine, not a knob.
    ``admission``: settings to try against the defaults (benchmarks/queue_bound.py)."""
    tiers: dict[str, object] = {"shared": {"rank": 2}}
    if point.victim_tier == "higher":
        tiers["first"] = {"rank": 1}
    return parse_config({
        "tiers": tiers,
        "tenants": {"victim": {"tier": point.victim_tier_name, "api_keys": [f"plain:{VICTIM_KEY}"]},
                    "flood": {"tier": "shared", "api_keys": [f"plain:{FLOOD_KEY}"]}},
        "backends": [{"name": f"engine-{i}", "url": f"http://127.0.0.1:{9 + i}",
                      "priority_scheduling": point.policy == "priority"}
                     for i in range(point.engines)],
        **({"admission": dict(admission)} if admission else {}),
    })


@dataclass(frozen=True, slots=True)
class ArmFigures:
    p50_s: float
    p90_s: float
    p99_s: float
    output_tokens_per_s: float
    victim_requests: int  # the victim's requests in the window
    unanswered: int = 0  # of those, without a first token by the run's end (TTFT inf)


@dataclass(frozen=True, slots=True)
class PointResult:
    point: IsolationPoint
    ideal_cap: int
    ideal: ArmFigures
    paced: ArmFigures  # ideal_run paced: the zero-overhead sidecar (context, not the bound)
    defaults: ArmFigures
    holds: dict[str, int] = field(default_factory=dict)  # the sidecar's, by backend/reason
    preemptions: int = 0  # the engine's, defaults arm, whole run
    wall_s: float = 0.0  # the defaults arm's simulation

    def ratio(self, q: Literal[50, 90, 99]) -> float:
        """The defaults' victim TTFT percentile over the ideal's."""
        mine = {50: self.defaults.p50_s, 90: self.defaults.p90_s, 99: self.defaults.p99_s}[q]
        bound = {50: self.ideal.p50_s, 90: self.ideal.p90_s, 99: self.ideal.p99_s}[q]
        return mine / bound if bound > 0 else math.inf

    @property
    def output_fraction(self) -> float:
        """The defaults' engine output as a fraction of the ideal's."""
        ideal = self.ideal.output_tokens_per_s
        return self.defaults.output_tokens_per_s / ideal if ideal > 0 else math.nan


class WindowEngine(SimEngine):
    """A SimEngine that also counts the tokens it generates in steps ending within
    ``[start_s, end_s)``, whether the loop takes its steps one by one or coasts them."""

    def __init__(self, name: str, options: EmulatorOptions, start_s: float, end_s: float,
                 seed_offset: int = 0) -> None:
        super().__init__(name, options, seed_offset)
        self.window = (start_s, end_s)
        self.window_tokens = 0

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        before = self.model.counters.generation_tokens
        out = super().advance(end_s)
        if self.window[0] <= end_s < self.window[1]:
            self.window_tokens += self.model.counters.generation_tokens - before
        return out

    def coast(self, plan: Coast, steps: int) -> tuple[list[float], float]:
        ends, following = super().coast(plan, steps)
        start, end = self.window
        inside = bisect.bisect_left(ends, end) - bisect.bisect_left(ends, start)
        self.window_tokens += len(plan.running) * inside
        return ends, following


@dataclass(frozen=True, slots=True)
class SimulationFigures:
    holds: dict[str, int]
    preemptions: int
    wall_s: float


def _lengths(prompt: int, output: int) -> Lengths:
    return Lengths.model_validate({"prompt": prompt, "output": output})


def run_defaults(point: IsolationPoint, warmup_s: float, window_s: float, tail_s: float,
                 seed: int, admission: Mapping[str, object] | None = None,
                 engine_type: type[WindowEngine] | None = None
                 ) -> tuple[ArmFigures, SimulationFigures, list[WindowEngine]]:
    """The defaults arm (``admission`` settings on top, if any), and its engines."""
    end_s = warmup_s + window_s
    until_s = end_s + tail_s
    config = plain_config(point, admission)
    tenants = (
        TenantSpec(name="flood", api_key=FLOOD_KEY, tier="shared",
                   lengths=_lengths(*point.flood_lengths),
                   arrival=Closed(users=FLOOD_USERS_PER_SLOT * point.slots * point.engines)),
        TenantSpec(name="victim", api_key=VICTIM_KEY, tier=point.victim_tier_name,
                   lengths=_lengths(*VICTIM),
                   arrival=Poisson(rate=point.victim_rate * point.engines)),
    )
    workload = Workload(scenario="isolation-matrix", phases=(PhaseSpan("flood", 0, until_s),),
                        tenants=tenants, victim="victim")
    engines = [(engine_type or WindowEngine)(f"engine-{i}", point.engine(), warmup_s, end_s,
                                             seed_offset=i)
               for i in range(point.engines)]
    sim = Simulation(config, list(engines),
                     WorkloadClients(workload, seed=seed, until_s=until_s),
                     run_id="isolation-matrix", scenario="isolation-matrix", until_s=until_s)
    result = sim.run()
    ttfts = sorted(math.inf if r.ttft_s is None else r.ttft_s for r in result.records
                   if r.tenant == "victim" and warmup_s <= r.scheduled_s < end_s)
    figures = ArmFigures(percentile(ttfts, 0.5), percentile(ttfts, 0.9),
                         percentile(ttfts, 0.99),
                         sum(e.window_tokens for e in engines) / window_s,
                         len(ttfts), sum(1 for t in ttfts if math.isinf(t)))
    preemptions = sum(e.model.counters.preemptions for e in engines)
    return figures, SimulationFigures(result.holds, preemptions, result.wall_s), engines


def run_ideal(point: IsolationPoint, warmup_s: float, window_s: float, seed: int, *,
              paced: bool = False) -> IdealPoint:
    options = point.engine()
    flood, victim = point.flood_lengths, VICTIM
    shape = IdealShape(engine=options.engine(), profile=options.step_profile(),
                       victim_rate=point.victim_rate, victim=lambda _rng: victim,
                       flood=lambda _rng: flood, warmup_s=warmup_s, victim_start_s=0.0)
    return ideal_run(shape, ideal_cap(point), warmup_s + window_s, seed, paced=paced)


def run_point(point: IsolationPoint, *, warmup_s: float = 10.0, window_s: float = 30.0,
              tail_s: float = 10.0, seed: int = 1) -> PointResult:
    ideal = run_ideal(point, warmup_s, window_s, seed)
    paced = run_ideal(point, warmup_s, window_s, seed, paced=True)
    defaults, sim, _engines = run_defaults(point, warmup_s, window_s, tail_s, seed)
    return PointResult(point=point, ideal_cap=ideal.cap,
                       ideal=_figures(ideal, point.engines),
                       paced=_figures(paced, point.engines), defaults=defaults,
                       holds=sim.holds, preemptions=sim.preemptions, wall_s=sim.wall_s)


def _figures(ideal: IdealPoint, engines: int) -> ArmFigures:
    """One engine's bound as the fleet's: each engine is loaded as the one simulated, so
    the victim's percentiles are that engine's and the output is ``engines`` times its."""
    return ArmFigures(ideal.victim_p50_s, ideal.victim_p90_s, ideal.victim_p99_s,
                      ideal.output_tokens_per_s * engines, ideal.victim_requests)

