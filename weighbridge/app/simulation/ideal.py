"""The zero-overhead bound: what an *ideal* sidecar gets a victim beside a flood, from the
engine's step model alone.

The ideal sidecar sends each victim request the instant it arrives, at the front of the
engine's priority queue, and keeps the flood at exactly ``cap`` sequences in the engine, its
prompts admitted one at a time (the best case of prefill pacing). No HTTP, no CPU, no
scrapes: only the step times. Unpaced (``paced=False``) it is a polite flood instead: ``cap``
closed-loop streams straight to the engine, each sending its next request the step its
previous one ends (the isolation matrix's bound, ``benchmarks.isolation_sim``).
``benchmarks/noisy_neighbour_bound.py`` tabulates it over caps; ``weighbridge simulate
--ideal`` computes it for the stack and scenario it simulates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weighbridge.app.simulation.run import Inputs, find_scenario, sidecar_for
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel
from weighbridge.emulator.profiles import StepTimeProfile
from weighbridge.loadgen.arrivals import Closed
from weighbridge.sidecar.admission import derive_limits
from weighbridge.sidecar.shape import EngineShape
from weighbridge.statistics import percentile

__all__ = ["IdealPoint", "IdealShape", "ideal_for", "ideal_run"]

Draw = Callable[[random.Random], tuple[int, int]]  # (prompt, output) tokens


@dataclass(frozen=True)
class IdealShape:
    engine: EngineConfig
    profile: StepTimeProfile
    victim_rate: float  # victim requests/s at this engine, Poisson
    victim: Draw
    flood: Draw
    warmup_s: float = 5.0  # victim requests before this are not counted
    victim_start_s: float = 1.0


@dataclass(frozen=True, slots=True)
class IdealPoint:
    cap: int  # flood sequences kept in the engine; 0 = no flood
    victim_p50_s: float
    victim_p99_s: float
    flood_tokens_per_s: float
    victim_p90_s: float
    output_tokens_per_s: float  # every token the engine generated, the victim's too
    victim_requests: int  # the victim's requests the percentiles are over


def ideal_run(shape: IdealShape, cap: int, seconds: float, seed: int = 7, *,
              paced: bool = True) -> IdealPoint:
    """The victim's TTFT over its requests that arrive from ``shape.warmup_s`` on and the
    engine's output over the same interval, up to ``seconds`` of virtual time."""
    model = StepModel(shape.engine, shape.profile)
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = shape.victim_start_s
    while t < seconds:
        t += rng.expovariate(shape.victim_rate)
        arrivals.append(t)
    lengths = random.Random(f"{seed}/lengths")
    flood: dict[str, Sequence] = {}
    victims: list[Sequence] = []
    now, k, n, flood_tokens, all_tokens = 0.0, 0, 0, 0, 0
    while now < seconds:
        # The ideal sidecar: top the flood up to its cap, one unprefilled prompt at a time
        # (unpaced: all at once, as closed-loop streams would).
        while len(flood) < cap and (not paced or all(s.first_token_s is not None
                                                     for s in flood.values())):
            prompt, output = shape.flood(lengths)
            seq = Sequence(f"a{n}", prompt, output, output, now, priority=1)
            n += 1
            model.add(seq)
            flood[seq.request_id] = seq
        while k < len(arrivals) and arrivals[k] <= now:
            prompt, output = shape.victim(lengths)
            seq = Sequence(f"b{k}", prompt, output, output, arrivals[k], priority=0)
            model.add(seq)
            victims.append(seq)
            k += 1
        result = model.step(now)
        if result is None:  # idle: jump to the next victim arrival
            now = arrivals[k] if k < len(arrivals) else seconds
            continue
        if now >= shape.warmup_s:
            flood_tokens += sum(1 for s in result.emitted if s.request_id in flood)
            all_tokens += len(result.emitted)
        for seq in result.finished:
            flood.pop(seq.request_id, None)
        now = result.end_s
    ttfts = sorted(s.first_token_s - s.arrival_s for s in victims
                   if s.arrival_s >= shape.warmup_s and s.first_token_s is not None)
    measured = seconds - shape.warmup_s
    return IdealPoint(cap, percentile(ttfts, 0.5), percentile(ttfts, 0.99),
                      flood_tokens / measured, victim_p90_s=percentile(ttfts, 0.9),
                      output_tokens_per_s=all_tokens / measured, victim_requests=len(ttfts))


def _offered_tokens_per_s(tenant: Any) -> float:
    prompt, output = tenant.lengths.mean_tokens()
    rates = [a.mean_rate() for a in [tenant.arrival, *tenant.phases.values()]
             if a is not None and not isinstance(a, Closed)]
    closed = any(isinstance(a, Closed) for a in [tenant.arrival, *tenant.phases.values()])
    rate = math.inf if closed else max(rates, default=0.0)
    return rate * (prompt + output)


def ideal_for(inputs: Inputs) -> dict[str, Any]:
    """The bound for a simulated run's shape: its engines, its scenario's victim (Poisson at
    its highest rate, split evenly over the engines) and, as the flood, the other tenant
    that offers the most tokens, held at each engine's share of the admission cap."""
    stack = inputs.stack
    scenario = find_scenario(inputs.scenario or stack.loadgen.scenario)
    tenants_file = inputs.tenants_file or (stack.tenants_file if inputs.scenario is None
                                           else None)
    workload = scenario.workload(tenants_file=tenants_file, scale=inputs.scale,
                                 stretch=inputs.stretch)
    victim = next((t for t in workload.tenants if t.name == workload.victim), None)
    others = [t for t in workload.tenants if t.name != workload.victim]
    if victim is None or not others:
        return {"error": "the scenario names no victim, or has no other tenant"}
    rates = [a.mean_rate() for a in [victim.arrival, *victim.phases.values()]
             if a is not None and not isinstance(a, Closed)]
    if not rates or not all(math.isfinite(r) for r in rates):
        return {"error": f"victim {victim.name!r} has no Poisson-like rate"}
    flood = max(others, key=_offered_tokens_per_s)
    admission = sidecar_for(stack).admission
    options = stack.engines.emulator
    # What the admission defaults let a flood hold, sized to the engine as the sidecar
    # learns it (sidecar.admission.derive_limits); the KV watermark is not modelled here.
    limits = derive_limits(admission, EngineShape(slots=options.max_num_seqs,
                                                  slots_exact=True,
                                                  kv_blocks=options.num_kv_blocks,
                                                  block_size=options.block_size))
    cap = min(options.max_num_seqs,
              (limits.max_running or limits.max_inflight) - limits.headroom_slots)
    shape = IdealShape(engine=options.engine(), profile=options.step_profile(),
                       victim_rate=max(rates) / stack.engines.count,
                       victim=victim.lengths.draw, flood=flood.lengths.draw)
    duration = workload.end_s if inputs.duration_s is None else inputs.duration_s
    seconds = min(max(60.0, duration if math.isfinite(duration) else 60.0), 600.0)
    alone = ideal_run(shape, 0, seconds, inputs.seed)
    flooded = ideal_run(shape, cap, seconds, inputs.seed)
    return {
        "victim": victim.name, "flood_tenant": flood.name, "cap_per_engine": cap,
        "victim_rate_per_engine": shape.victim_rate, "virtual_s": seconds,
        "engines": stack.engines.count,
        "alone": {"ttft_p50_s": alone.victim_p50_s, "ttft_p90_s": alone.victim_p90_s,
                  "ttft_p99_s": alone.victim_p99_s},
        "flooded": {"ttft_p50_s": flooded.victim_p50_s, "ttft_p90_s": flooded.victim_p90_s,
                    "ttft_p99_s": flooded.victim_p99_s,
                    "flood_tokens_per_s": flooded.flood_tokens_per_s,
                    # Every token one engine generates, the victim's too: the fleet's
                    # bound is this times "engines".
                    "output_tokens_per_s": flooded.output_tokens_per_s},
        "victim_ttft_ratio": flooded.victim_p99_s / alone.victim_p99_s
        if alone.victim_p99_s > 0 else None,
    }
