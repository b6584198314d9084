"""Scheduling quality: the sidecar's policies on the noisy-neighbour, tiers and bimodal
scenarios, every figure from the run's own report (summary.json), throughput relative to
``passthrough`` measured in the same benchmark run.

Each (scenario, policy) is one fresh local stack — the demo's (deploy/stacks/noisy-neighbour
.yaml: two emulated H100 engines of 32 sequences, priority scheduling, the sidecar's
admission gate with headroom and prefill pacing) with the scenario's tenants — and one
headless Locust run through it. Only ``scheduler`` changes between the policies:
``passthrough`` (no queue, no gate: straight to the engines), ``fcfs``, ``rr``, ``drr`` and
``drr`` without live charging of streamed tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from benchmarks import _results
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.kv_pressure import Unhinted, mean_only
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import HeadlineFigures, headline_figures
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.loadrun import LoadRun
from weighbridge.app.simulation.clients import Clients, WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.app.simulation.run import Inputs, scenario_load, sidecar_for
from weighbridge.app.stack import (
    DEFAULT_STACK,
    Loadgen,
    LocalStack,
    Ports,
    StackSpec,
    load_stack,
    parse_stack,
)
from weighbridge.emulator.engine import Sequence as Sequence_
from weighbridge.emulator.engine import StepResult
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Closed, Poisson
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec, load_tenants
from weighbridge.records import RequestRecord
from weighbridge.resources import DEPLOY_DIR, SCENARIOS_DIR
from weighbridge.sidecar import request as request_module
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.estimator import OutputEstimator

REPORT_WINDOW_S = 2.0
FULL_STRETCH = 0.3  # phases of ~60 s become ~18 s: 15 runs in about 6 minutes
QUICK_STRETCH = 0.15


@dataclass(frozen=True)
class ScenarioCase:
    name: str
    tenants_file: Path
    scale: float = 1.0
    why: str = ""


CASES = (
    ScenarioCase("noisy_neighbour", DEFAULT_STACK.parent / "noisy-neighbour-tenants.yaml",
                 why="the demo's sizing of the flood (1,200 requests in 20 s)"),
    # Twice the scenario's load: 64 closed-loop batch users fill both engines.
    ScenarioCase("tiers", SCENARIOS_DIR / "tenants" / "tiers.yaml", scale=2.0,
                 why="--scale 2: 64 closed-loop batch users, twice the rates"),
    # Three times the scenario's rates: the essays saturate the engines, so the four
    # tenants queue together and fairness among them is measured.
    ScenarioCase("bimodal", SCENARIOS_DIR / "tenants" / "bimodal.yaml", scale=3.0,
                 why="--scale 3: the essays saturate both engines, every tenant queues"),
)

POLICIES: dict[str, dict[str, Any]] = {
    "passthrough": {"policy": "passthrough"},
    "fcfs": {"policy": "fcfs"},
    "rr": {"policy": "rr"},
    "drr": {"policy": "drr", "charge_streamed_tokens": True},
    "drr, no live charging": {"policy": "drr", "charge_streamed_tokens": False},
}
BASELINE_POLICY = "passthrough"


def sidecar_tenants(tenants_file: Path) -> dict[str, Any]:
    """The sidecar's tenants for a load-generator tenants file: same names, tiers, weights
    and keys; queues deep enough that a flood is queued, not turned away at once."""
    out: dict[str, Any] = {}
    for t in load_tenants(tenants_file).tenants:
        if t.api_key is None:
            raise ValueError(f"{tenants_file}: tenant {t.name} has no api_key")
        out[t.name] = {"tier": t.tier, "weight": t.weight,
                       "api_keys": [f"plain:{t.api_key}"], "limits": {"max_queued": 2000}}
    return out


def case_stack(base: StackSpec, case: ScenarioCase, scheduler: dict[str, Any]) -> StackSpec:
    spec = base.with_sidecar(tenants=sidecar_tenants(case.tenants_file), scheduler=scheduler)
    return spec.model_copy(update={
        "name": f"{case.name}-{scheduler['policy']}",
        "loadgen": Loadgen(scenario=case.name, tenants_file=str(case.tenants_file),
                           exporter_port=0),
        "prometheus": "off", "ports": Ports()})


def run_case(spec: StackSpec, case: ScenarioCase, stretch: float, directory: Path,
             ctx: BenchContext, label: str) -> HeadlineFigures:

    task = ctx.progress.add_task(f"{label}: starting", total=None)
    with LocalStack(spec, directory / "stack") as stack:
        run = LoadRun(scenario=case.name, host=stack.urls.sidecar, run_dir=directory / "run",
                      log_path=directory / "stack" / "logs" / "locust.log",
                      tenants_file=case.tenants_file, stretch=stretch, scale=case.scale,
                      seed=1)
        duration = run.duration_s()
        ctx.progress.update(task, description=label, total=duration, completed=0)
        run.run(on_tick=lambda s: ctx.progress.update(task, completed=min(s, duration)))
    ctx.progress.update(task, description=f"{label}: report", completed=duration)
    result = headline_figures(summary(analyse(load_run(directory / "run"), REPORT_WINDOW_S)))
    ctx.progress.remove_task(task)
    return result


def _ratio(value: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def table_rows(case: str, results: dict[str, HeadlineFigures]) -> list[tuple[str, ...]]:
    base = results.get(BASELINE_POLICY)
    base_tps = base.served_tokens_per_s if base else None
    rows: list[tuple[str, ...]] = []
    for policy, head in results.items():
        tps = head.served_tokens_per_s
        relative = tps / base_tps if tps is not None and base_tps else None
        label = f"{policy} (baseline)" if policy == BASELINE_POLICY else policy
        rows.append((
            case, label, head.victim or "—", _ratio(head.victim_ratio, ".1f"),
            _ratio(head.jain_index, ".3f", ""), head.tier1 or "—",
            _ms(head.tier1_ttft_p99_s), _pct(head.tier1_slo_attainment),
            "—" if tps is None else f"{tps:,.0f}", f"**{_ratio(relative)}**"))
    return rows


# ---------------------------------------------------------------------------- claims
# Issue 41, point 11: the seeds' claims, each measured in virtual time through the core the
# live sidecar runs (weighbridge.app.simulation), so the figures repeat on every run.

CLAIM_SEEDS = (1, 2, 3)


def _rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile of sorted ``values`` (inf-safe, unlike interpolation)."""
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def _spread(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}x"


# -- (a) routing spread ---------------------------------------------------------------------

SPREAD_ENGINES = 4
SPREAD_SCALES = (1.0, 2.0)
SPREAD_WARMUP_S, SPREAD_UNTIL_S = 10.0, 40.0  # the scenario's load phase, after a warm-up
SPREAD_ARMS = ("round_robin", "least_requests", "least_tokens", "prefix_aware",
               "least_tokens, mean estimate", "least_tokens, exact output")


def _outstanding(engine: SimEngine) -> int:
    """Token work an engine holds: prompt tokens not yet computed and output tokens not yet
    generated, over every sequence running or waiting there."""
    model = engine.model
    return sum(max(0, s.prompt_tokens - s.num_computed_tokens)
               + max(0, s.target_output_tokens - s.output_tokens)
               for s in (*model.running, *model.waiting))


class LoadSampler(Simulation):
    """A Simulation that reads every engine's outstanding token work at each scrape in
    ``[start_s, end_s)``."""

    def __init__(self, *args: Any, start_s: float, end_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = (start_s, end_s)
        self.samples: list[list[int]] = []

    def _poll(self, now: float, replica: int) -> None:
        if self.window[0] <= now < self.window[1]:
            self.samples.append([_outstanding(e) for e in self.engines])
        super()._poll(now, replica)


class ExactOutput(OutputEstimator):
    """A candidate, measured by substitution: a request's ``max_tokens`` is its expected
    output (exact for the load generator's ``ignore_eos`` requests): token-aware routing with
    the output known, the seed's output-length hint taken at its word."""

    def estimate(self, tenant: str, endpoint: str, max_tokens: int | None,
                 sequences: int = 1, model: str | None = None) -> int:
        if max_tokens is None:
            return super().estimate(tenant, endpoint, max_tokens, sequences, model)
        return sequences * max_tokens

    def final(self, tenant: str, endpoint: str, generated: int, max_tokens: int | None,
              model: str | None = None) -> int | None:
        if max_tokens is None:
            return super().final(tenant, endpoint, generated, max_tokens, model)
        return max_tokens


@dataclass(frozen=True)
class SpreadFigures:
    arm: str
    scale: float
    ratio_p50: float  # max/min outstanding token work over the engines, per scrape
    ratio_p90: float
    idle_share: float  # scrapes with an engine idle beside a loaded one
    mean_ratio: float  # the engines' mean outstanding work, max over min
    ttft_p99_s: float
    e2e_p99_s: float
    short_ttft_p99_s: float  # the classifications' (answers under SHORT_OUTPUT tokens)
    preemptions: float  # a run, over the engines


SHORT_OUTPUT = 1000  # tokens: the bimodal scenario's classifications are under it, essays over


def spread_stack(routing: str) -> StackSpec:
    data = load_stack(DEPLOY_DIR / "stacks" / "bimodal.yaml").model_dump()
    data["engines"]["count"] = SPREAD_ENGINES
    data["sidecar"]["routing"] = routing.split(",")[0]
    # The standard tier without its 10 s end-to-end SLO: early rejection would turn essays
    # away where their output is known, and every arm must route the same requests.
    data["sidecar"]["tiers"] = {"standard": {"rank": 2}}
    return parse_stack(data, source=f"bimodal x{SPREAD_ENGINES} ({routing})")


def run_spread(arm: str, scale: float) -> SpreadFigures:
    samples: list[list[int]] = []
    records: list[RequestRecord] = []
    preempted = 0
    for seed in CLAIM_SEEDS:
        stack = spread_stack(arm)
        config = sidecar_for(stack)
        load = scenario_load(Inputs(stack=stack, scale=scale, seed=seed), "spread")
        # engines_for's engines, counting their preemptions
        engines = [PreemptionCounter(f"engine-{i}", stack.engines.emulator_for(i),
                                     seed_offset=i) for i in range(stack.engines.count)]
        sim = LoadSampler(config, engines, load.clients, run_id="spread",
                          scenario=load.scenario, until_s=load.until_s,
                          start_s=SPREAD_WARMUP_S, end_s=SPREAD_UNTIL_S)
        core = sim.core
        if arm.endswith("exact output"):
            core.estimator = ExactOutput(
                {path: e.initial_output_estimate for path, e in config.endpoints.items()},
                config.scheduler.output_estimate_alpha)
        elif arm.endswith("mean estimate"):
            core.estimator = mean_only(config)
        records += sim.run().records
        samples += sim.samples
        preempted += sum(len(e.preempted) for e in engines)
    ratios = sorted(max(s) / min(s) if min(s) > 0 else math.inf
                    for s in samples if max(s) > 0)
    means = [statistics.fmean(column) for column in zip(*samples, strict=True)]
    window = [r for r in records if SPREAD_WARMUP_S <= r.scheduled_s < SPREAD_UNTIL_S]
    ok = [r for r in window if r.status == "ok"]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    e2e = sorted(r.end_s - r.scheduled_s for r in ok)
    return SpreadFigures(
        arm, scale, _rank(ratios, 0.5), _rank(ratios, 0.9),
        sum(1 for s in samples if min(s) == 0 < max(s)) / max(1, len(samples)),
        max(means) / min(means) if min(means) > 0 else math.inf,
        _rank(ttft, 0.99), _rank(e2e, 0.99),
        _rank(sorted(r.ttft_s for r in ok if r.ttft_s is not None
                     and (r.output_tokens or 0) < SHORT_OUTPUT), 0.99),
        preempted / len(CLAIM_SEEDS))


def spread_table(results: Sequence[SpreadFigures]) -> Table:
    rows: list[tuple[str, ...]] = [
        (f"{f.scale:g}", f.arm, _spread(f.ratio_p50), _spread(f.ratio_p90),
         f"{f.idle_share:.1%}", _spread(f.mean_ratio), f"{f.ttft_p99_s * 1000:,.0f}",
         f"{f.short_ttft_p99_s * 1000:,.0f}", f"{f.e2e_p99_s:.1f}", f"{f.preemptions:.0f}")
        for f in results]
    return Table(("scale", "routing", "max/min token work p50", "p90",
                  "scrapes with an engine idle beside a loaded one", "mean work max/min",
                  "TTFT p99 ms", "classifications' TTFT p99 ms", "e2e p99 s",
                  "preemptions / run"), rows,
                 caption=f"**(a) routing spread**: bimodal on {SPREAD_ENGINES} engines")


# -- a sidecar in front of engines, for claims (b)-(d) ------------------------------------

CLAIM_ENGINE: dict[str, Any] = {"profile": "h100-llama3-8b", "max_num_seqs": 32,
                                "max_num_batched_tokens": 2048, "block_size": 16,
                                "num_kv_blocks": 4096, "max_model_len": 8192,
                                "scheduling_policy": "priority"}
CLAIM_WARMUP_S, CLAIM_WINDOW_S, CLAIM_TAIL_S = 10.0, 60.0, 20.0


def _lengths(prompt: object, output: object) -> Lengths:
    return Lengths.model_validate({"prompt": prompt, "output": output})


def claim_run(sidecar: Mapping[str, Any], tenants: Sequence[TenantSpec], seed: int,
              models: Sequence[str | None] = (None,),
              engine: Mapping[str, Any] | None = None,
              clients: Callable[[WorkloadClients], Clients] | None = None,
              simulation: type[Simulation] = Simulation,
              engine_type: type[SimEngine] = SimEngine) -> Simulation:
    """One run, done: ``sidecar`` (tiers, tenants, scheduler, ...) in front of one engine
    per entry of ``models`` (the model it serves; None: the default), every tier without an
    SLO so nothing is turned away early (``.records``: the whole run's)."""
    until = CLAIM_WARMUP_S + CLAIM_WINDOW_S + CLAIM_TAIL_S
    flags: dict[str, Any] = {**CLAIM_ENGINE, **(engine or {})}
    options = [EmulatorOptions(**{**flags, **({"model_name": m} if m else {})})
               for m in models]
    config = parse_config({**sidecar, "backends": [
        {"name": f"engine-{i}", "url": f"http://127.0.0.1:{9 + i}",
         "priority_scheduling": flags["scheduling_policy"] == "priority",
         **({"models": [m]} if m else {})} for i, m in enumerate(models)]})
    workload = Workload(scenario="claims", phases=(PhaseSpan("load", 0, until),),
                        tenants=tuple(tenants))
    base = WorkloadClients(workload, seed=seed, until_s=until)
    sim = simulation(config, [engine_type(f"engine-{i}", o, seed_offset=i)
                              for i, o in enumerate(options)],
                     clients(base) if clients else base, run_id="claims",
                     scenario="claims", until_s=until)
    sim.run()
    return sim


def in_window(records: Sequence[RequestRecord], tenant: str) -> list[RequestRecord]:
    end = CLAIM_WARMUP_S + CLAIM_WINDOW_S
    return [r for r in records if r.tenant == tenant and CLAIM_WARMUP_S <= r.scheduled_s < end]


def ttfts(records: Sequence[RequestRecord]) -> list[float]:
    """Sorted TTFTs; a request never answered counts as infinite."""
    return sorted(math.inf if r.ttft_s is None else r.ttft_s for r in records)


def _ms_q(values: Sequence[float], *qs: float) -> str:
    return " / ".join("inf" if math.isinf(v := _rank(values, q)) else f"{v * 1000:,.0f}"
                      for q in qs)


def output_tps(records: Sequence[RequestRecord], tenant: str) -> float:
    """The tenant's output tokens of the requests that ended ok in the window, per second."""
    end = CLAIM_WARMUP_S + CLAIM_WINDOW_S
    return sum(r.output_tokens or 0 for r in records if r.tenant == tenant
               and r.status == "ok" and CLAIM_WARMUP_S <= r.end_s < end) / CLAIM_WINDOW_S


# -- (b) repeat demotion, per key -------------------------------------------------------------

SCRIPT_KEY, PERSON_KEY, OTHER_KEY = "sk-team-script", "sk-team-person", "sk-other"


def flood_tenant() -> TenantSpec:
    """``other``: 48 closed-loop users of 256 + 128 tokens, so the tenant beside it is served
    at its share and queues."""
    return TenantSpec(name="other", api_key=OTHER_KEY, tier="shared",
                      lengths=_lengths(256, 128), arrival=Closed(users=48))


def beside_flood(tenant: str, keys: Sequence[str], scheduler: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """The sidecar: ``tenant`` behind ``keys`` and ``other`` behind its own, one tier."""
    return {"tiers": {"shared": {"rank": 1}},
            "tenants": {tenant: {"tier": "shared", "api_keys": [f"plain:{k}" for k in keys]},
                        "other": {"tier": "shared", "api_keys": [f"plain:{OTHER_KEY}"]}},
            "scheduler": dict(scheduler)}


def demotion_tenants() -> list[TenantSpec]:
    """One sidecar tenant, ``team``, behind two keys: a script's closed loop of 48 users and
    a person's Poisson 1/s; ``other`` floods beside it, so team's queue is backlogged."""
    return [
        TenantSpec(name="team-script", api_key=SCRIPT_KEY, tier="shared",
                   lengths=_lengths(256, 128), arrival=Closed(users=48)),
        TenantSpec(name="team-person", api_key=PERSON_KEY, tier="shared",
                   lengths=_lengths(64, 32), arrival=Poisson(rate=1.0)),
        flood_tenant(),
    ]


def demotion_sidecar(on: bool) -> dict[str, Any]:
    return beside_flood("team", (SCRIPT_KEY, PERSON_KEY), {"repeat_demotion": on})


def priority_tenants() -> list[TenantSpec]:
    """The cost side: one tenant, ``solo``, behind one key, ordering its own requests by the
    body's ``priority``: urgent ones (0, Poisson 1/s) among bulk ones (5, 48 users); ``other``
    floods beside it."""
    return [
        TenantSpec(name="solo-bulk", api_key="sk-solo", tier="shared", priority=5,
                   lengths=_lengths(256, 128), arrival=Closed(users=48)),
        TenantSpec(name="solo-urgent", api_key="sk-solo", tier="shared", priority=0,
                   lengths=_lengths(64, 32), arrival=Poisson(rate=1.0)),
        flood_tenant(),
    ]


def priority_sidecar(on: bool) -> dict[str, Any]:
    return beside_flood("solo", ("sk-solo",), {"repeat_demotion": on})


def demotion_table() -> tuple[Table, list[str]]:
    rows: list[tuple[str, ...]] = []
    lines: list[str] = []
    for case, sidecar, tenants, light, heavy in (
            ("two keys", demotion_sidecar, demotion_tenants, "team-person", "team-script"),
            ("one key, body priorities", priority_sidecar, priority_tenants, "solo-urgent",
             "solo-bulk")):
        for on in (False, True):
            records = [r for seed in CLAIM_SEEDS
                       for r in claim_run(sidecar(on), tenants(), seed).records]
            heavy_ttfts = ttfts(in_window(records, heavy))
            light_ttfts = ttfts(in_window(records, light))
            lines.append(f"(b) repeat demotion {'on' if on else 'off'}, {case}: light p99 "
                         f"{_ms_q(light_ttfts, 0.99)} ms, heavy unanswered "
                         f"{sum(1 for t in heavy_ttfts if math.isinf(t))}")
            rows.append((case, "on" if on else "off (default)",
                         _ms_q(ttfts(in_window(records, light)), 0.5, 0.9, 0.99),
                         _ms_q(heavy_ttfts, 0.5, 0.99),
                         f"{sum(1 for t in heavy_ttfts if math.isinf(t))} / "
                         f"{len(heavy_ttfts)}",
                         f"{output_tps(records, heavy) / len(CLAIM_SEEDS):,.0f}",
                         f"{output_tps(records, 'other') / len(CLAIM_SEEDS):,.0f}"))
    return Table(("case", "repeat_demotion", "light requests TTFT ms p50 / p90 / p99",
                  "heavy requests TTFT ms p50 / p99", "heavy unanswered / sent",
                  "heavy output tok/s",
                  "other tenant output tok/s"), rows,
                 caption="**(b) repeat demotion**: one tenant beside a flooding one; two "
                         "keys (light: a person's 1/s, heavy: a script's 48 users), or one "
                         "key whose urgent requests (light, priority 0) come among bulk ones "
                         "(heavy, priority 5)"), lines


# -- (c) shortest-prompt-first with aging -------------------------------------------------

SPF_SHORT, SPF_LONG = 64, 4096  # prompt tokens of the mixed tenant's two kinds
# Requests/s: about 0.9 and 1.0 of what its share serves (8/s: closed loop, FIFO).
SPF_RATES = (7.0, 8.0)
SPF_ARMS: tuple[tuple[str, bool, float], ...] = (
    ("off", False, request_module.SPF_MAX_DELAY_S),
    ("on, no aging", True, 1e9),  # a delay bound no run reaches: strict shortest-first
    ("on, aging 8 s", True, 8.0),
    ("on, aging 2 s (default)", True, 2.0),
    ("on, aging 0.5 s", True, 0.5),
)


@contextlib.contextmanager
def spf_bound(max_delay_s: float) -> Iterator[None]:
    """``spf_delay_s`` with another bound for one arm (the product's is
    ``SPF_MAX_DELAY_S``)."""
    original = request_module.spf_delay_s

    def bounded(prompt_tokens: int, max_delay_s: float = max_delay_s) -> float:
        return original(prompt_tokens, max_delay_s)

    request_module.spf_delay_s = bounded
    try:
        yield
    finally:
        request_module.spf_delay_s = original


def spf_tenants(rate: float) -> list[TenantSpec]:
    """``mixed``: Poisson ``rate``/s, 80% short prompts and 20% long ones, 32 output
    tokens each; ``other`` floods beside it, so mixed is served at its share and queues
    (open loop: a closed one's mean wait is its users over its throughput, whatever the
    order)."""
    return [
        TenantSpec(name="mixed", api_key="sk-mixed", tier="shared",
                   arrival=Poisson(rate=rate),
                   lengths=Lengths.model_validate({"classes": [
                       {"weight": 0.8, "prompt": SPF_SHORT, "output": 32},
                       {"weight": 0.2, "prompt": SPF_LONG, "output": 32}]})),
        flood_tenant(),
    ]


def spf_sidecar(on: bool) -> dict[str, Any]:
    return beside_flood("mixed", ("sk-mixed",), {"shortest_prompt_first": on})


def spf_table() -> tuple[Table, list[str]]:
    rows: list[tuple[str, ...]] = []
    lines: list[str] = []
    for rate in SPF_RATES:
        for label, on, bound in SPF_ARMS:
            with spf_bound(bound):
                records = [r for seed in CLAIM_SEEDS
                           for r in claim_run(spf_sidecar(on), spf_tenants(rate), seed).records]
            mixed = in_window(records, "mixed")
            short = ttfts([r for r in mixed if (r.prompt_tokens or 0) < SPF_LONG // 2])
            long = ttfts([r for r in mixed if (r.prompt_tokens or 0) >= SPF_LONG // 2])
            every = ttfts(mixed)
            finite = [t for t in every if math.isfinite(t)]
            mean = f"{statistics.fmean(finite) * 1000:,.0f}" if finite else "—"
            lines.append(f"(c) shortest-prompt-first {label}, {rate:g}/s: mixed TTFT mean "
                         f"{mean} ms, long prompts' p99 {_ms_q(long, 0.99)} ms")
            rows.append((f"{rate:g}", label, mean, _ms_q(short, 0.5, 0.99),
                         _ms_q(long, 0.5, 0.99, 1.0), f"{sum(1 for t in every if math.isinf(t))}",
                         f"{output_tps(records, 'mixed') / len(CLAIM_SEEDS):,.0f}"))
    return Table(("mixed rate /s", "shortest_prompt_first", "mixed TTFT mean ms",
                  "short prompts TTFT ms p50 / p99", "long prompts TTFT ms p50 / p99 / max",
                  "unanswered", "mixed output tok/s"), rows,
                 caption=f"**(c) shortest-prompt-first**: a tenant of {SPF_SHORT}- and "
                         f"{SPF_LONG}-token prompts (80/20), Poisson, beside a flood"), lines


# -- (d) per-model output estimates ---------------------------------------------------------

MODEL_OUTPUTS = {"model-a": 32, "model-b": 1024}  # each model's answers, no max_tokens sent
MODEL_ENGINE = {"num_kv_blocks": 1024}  # 16,384 tokens: a model-b answer is 80 blocks


class EstimateRecorder(Simulation):
    """A Simulation that keeps, for every request that completes, its model, the output the
    sidecar expected at arrival and the output it had."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.estimates: list[tuple[str, str, int, int]] = []  # tenant, model, expected, real

    def _finished(self, finished: list[Sequence_], now: float) -> None:
        for seq in finished:
            flight = self._flights.get(seq.request_id)
            if flight is not None:
                self.estimates.append((flight.client.plan.tenant, flight.client.plan.model
                                       or "", flight.request.estimated_output_tokens,
                                       seq.output_tokens))
        super()._finished(finished, now)


class NoModelKey(OutputEstimator):
    """The estimator before decision 0019 (d), measured by substitution: one key per
    (tenant, endpoint), every model's answers in it."""

    def estimate(self, tenant: str, endpoint: str, max_tokens: int | None,
                 sequences: int = 1, model: str | None = None) -> int:
        return super().estimate(tenant, endpoint, max_tokens, sequences)

    def final(self, tenant: str, endpoint: str, generated: int, max_tokens: int | None,
              model: str | None = None) -> int | None:
        return super().final(tenant, endpoint, generated, max_tokens)

    def observe(self, tenant: str, endpoint: str, output_tokens: int,
                model: str | None = None) -> None:
        super().observe(tenant, endpoint, output_tokens)


class NoModelKeyRecorder(EstimateRecorder):
    """``EstimateRecorder`` whose core estimates without the model key (``NoModelKey``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.core.config
        self.core.estimator = NoModelKey(
            {path: e.initial_output_estimate for path, e in config.endpoints.items()},
            config.scheduler.output_estimate_alpha)


MODEL_ARMS = (("(tenant, endpoint, model): the estimator's", False, EstimateRecorder),
              ("(tenant, endpoint): before 0019 (d)", False, NoModelKeyRecorder),
              ("a tenant per model", True, EstimateRecorder))


def model_tenants(split: bool) -> list[TenantSpec]:
    """``app`` on both models (48 users each, 256-token prompts, no ``max_tokens``): one key,
    or with ``split`` a key per model (each its own sidecar tenant: the model key the
    estimator lacks, emulated); ``chat-a`` and ``chat-b``, Poisson 2/s of 64 + 16 on each."""
    tenants = [TenantSpec(name=f"app-{m[-1]}", api_key=f"sk-app-{m[-1]}" if split else "sk-app",
                          tier="shared", endpoint="chat", model=m, arrival=Closed(users=48),
                          lengths=_lengths(256, out)) for m, out in MODEL_OUTPUTS.items()]
    return tenants + [TenantSpec(name=f"chat-{m[-1]}", api_key=f"sk-chat-{m[-1]}",
                                 tier="shared", model=m, arrival=Poisson(rate=2.0),
                                 lengths=_lengths(64, 16)) for m in MODEL_OUTPUTS]


def model_sidecar(split: bool) -> dict[str, Any]:
    apps = ({f"app-{m[-1]}": [f"plain:sk-app-{m[-1]}"] for m in MODEL_OUTPUTS} if split
            else {"app": ["plain:sk-app"]})
    keys = {**apps, **{f"chat-{m[-1]}": [f"plain:sk-chat-{m[-1]}"] for m in MODEL_OUTPUTS}}
    return {"tiers": {"shared": {"rank": 1}},
            "tenants": {name: {"tier": "shared", "api_keys": k} for name, k in keys.items()}}


class PreemptionCounter(SimEngine):
    """A SimEngine counting the sequences it preempts, by request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preempted: list[str] = []

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        if self.batch is not None and self.batch.preempted:
            self.preempted.extend(s.request_id for s in self.batch.preempted)
        return super().advance(end_s)


def model_table() -> tuple[Table, list[str]]:
    rows: list[tuple[str, ...]] = []
    lines: list[str] = []
    for label, split, recorder in MODEL_ARMS:
        records: list[RequestRecord] = []
        estimates: list[tuple[str, str, int, int]] = []
        preempted: dict[str, int] = {}
        for seed in CLAIM_SEEDS:
            sim = claim_run(model_sidecar(split), model_tenants(split), seed,
                            models=list(MODEL_OUTPUTS), engine=MODEL_ENGINE,
                            clients=lambda base: Unhinted(
                                base, lambda c: c.plan.tenant.startswith("app")),
                            simulation=recorder, engine_type=PreemptionCounter)
            assert isinstance(sim, EstimateRecorder)
            records += sim.records
            estimates += sim.estimates
            for engine in sim.engines:
                assert isinstance(engine, PreemptionCounter)
                preempted[engine.served_model] = (preempted.get(engine.served_model, 0)
                                                  + len(engine.preempted))
        for model, real in MODEL_OUTPUTS.items():
            mine = [e for e in estimates if e[0].startswith("app") and e[1] == model]
            chat = f"chat-{model[-1]}"
            if model == "model-b":
                lines.append(f"(d) {label}: model-b's "
                             f"{real}-token answers expected at "
                             f"{statistics.fmean(e[2] for e in mine):,.0f}, "
                             f"{preempted.get(model, 0) / len(CLAIM_SEEDS):.0f} preemptions "
                             f"a run, chat-b TTFT p99 "
                             f"{_ms_q(ttfts(in_window(records, chat)), 0.99)} ms")
            rows.append((
                label, model,
                f"{real}", f"{statistics.fmean(e[2] for e in mine):,.0f}" if mine else "—",
                f"{statistics.fmean(abs(e[2] - e[3]) for e in mine):,.0f}" if mine else "—",
                f"{preempted.get(model, 0) / len(CLAIM_SEEDS):.0f}",
                _ms_q(ttfts(in_window(records, chat)), 0.5, 0.99),
                f"{output_tps(records, f'app-{model[-1]}') / len(CLAIM_SEEDS):,.0f}"))
    return Table(("estimator key", "model", "real output", "app's estimate (mean)",
                  "mean abs error", "preemptions / run", "chat TTFT ms p50 / p99",
                  "app output tok/s"), rows,
                 caption="**(d) per-model estimates**: one tenant on two models (answers of "
                         f"{' and '.join(str(v) for v in MODEL_OUTPUTS.values())} tokens, "
                         "no max_tokens), one engine each"), lines


def spread_summary(results: Sequence[SpreadFigures]) -> list[str]:
    lines = []
    for scale in sorted({f.scale for f in results}):
        by = {f.arm: f for f in results if f.scale == scale}
        lines.append(f"(a) routing spread, bimodal x{scale:g}: max/min token work p50 / p90 "
                     + ", ".join(f"{arm} {_spread(f.ratio_p50)} / {_spread(f.ratio_p90)}"
                                 for arm, f in by.items()))
    return lines


CLAIMS_NOTES = [
    "Claims (issue 41, point 11) run in virtual time (weighbridge.app.simulation: the "
    "sidecar's SchedulingCore in front of the emulator's step model), seeds "
    f"{', '.join(map(str, CLAIM_SEEDS))} pooled; every tier without an SLO, so no arm "
    "turns requests away early.",
    f"(a) deploy/stacks/bimodal.yaml on {SPREAD_ENGINES} h100-llama3-8b engines, the "
    "bimodal scenario at --scale 1 and 2; each engine's outstanding token work (prompt not "
    "yet computed + output not yet generated, of everything running or waiting there) read "
    f"at every scrape from {SPREAD_WARMUP_S:g} s to {SPREAD_UNTIL_S:g} s. least_tokens "
    "counts an answer's outstanding output as its expected final length given what it "
    "generated, less that (decision 0018); 'mean estimate' (before it: the estimate less "
    "what streamed, 0 once outrun) and 'exact output' (the estimate taken from max_tokens) "
    "are measured by substitution.",
    "(b)-(d) one h100-llama3-8b engine per model, 32 sequences, step budget 2,048, "
    "priority scheduling; requests sent in "
    f"[{CLAIM_WARMUP_S:g}, {CLAIM_WARMUP_S + CLAIM_WINDOW_S:g}) s, the run "
    f"{CLAIM_TAIL_S:g} s longer; TTFT inf: unanswered by then.",
    "(c) the aging bound is spf_delay_s's max_delay_s (sidecar/request.py, "
    "SPF_MAX_DELAY_S); 'no aging' sets it past any run. (d) 'before 0019 (d)' is the "
    "estimator without its model key, by substitution; 'a tenant per model' gives each "
    "model's traffic a sidecar tenant of its own (the model key, emulated, as measured "
    "before the estimator had one).",
]


def run_claims(log: Callable[[str], None]) -> tuple[list[str], list[Table]]:
    """The claims' summary lines and tables."""
    started = time.perf_counter()
    spread = [run_spread(arm, scale) for scale in SPREAD_SCALES for arm in SPREAD_ARMS]
    log(f"(a) routing spread: {time.perf_counter() - started:.0f} s")
    tables, summary = [spread_table(spread)], spread_summary(spread)
    for name, part in (("(b) repeat demotion", demotion_table), ("(c) shortest-prompt-first",
                       spf_table), ("(d) per-model estimates", model_table)):
        started = time.perf_counter()
        table, lines = part()
        tables.append(table)
        summary += lines
        log(f"{name}: {time.perf_counter() - started:.0f} s")
    return summary, tables


def run(ctx: BenchContext) -> BenchResult:
    policies = run_policies(ctx)
    summary, tables = run_claims(ctx.log)
    return BenchResult(summary=policies.summary + summary, tables=policies.tables + tables,
                       notes=policies.notes + CLAIMS_NOTES, passed=None)


def run_policies(ctx: BenchContext) -> BenchResult:
    stretch = QUICK_STRETCH if ctx.quick else FULL_STRETCH
    base = load_stack(DEFAULT_STACK)
    root = Path(tempfile.mkdtemp(prefix="weighbridge-scheduling-quality-"))
    results: dict[str, dict[str, HeadlineFigures]] = {}
    task = ctx.progress.add_task("scheduling quality", total=len(CASES) * len(POLICIES))
    for case in CASES:
        results[case.name] = {}
        for policy, scheduler in POLICIES.items():
            slug = f"{case.name}-{policy.replace(', ', '-').replace(' ', '-')}"
            results[case.name][policy] = run_case(
                case_stack(base, case, scheduler), case, stretch, root / slug, ctx,
                f"{case.name} / {policy}")
            ctx.progress.advance(task)
    ctx.progress.remove_task(task)
    shutil.rmtree(root, ignore_errors=True)  # kept above only when a run failed

    rows = [row for case in CASES for row in table_rows(case.name, results[case.name])]
    summary = []
    for case in CASES:
        by = results[case.name]
        ratios = {p: h.victim_ratio for p, h in by.items() if h.victim_ratio is not None}
        if ratios:
            best = min(ratios, key=lambda p: ratios[p])
            worst = max(ratios, key=lambda p: ratios[p])
            summary.append(f"{case.name}: victim p99 TTFT flood/quiet {ratios[best]:.1f}x "
                           f"with {best}, {ratios[worst]:.1f}x with {worst}")
        slo = {p: h.tier1_slo_attainment for p, h in by.items()
               if h.tier1_slo_attainment is not None}
        if slo:
            tier = next(h.tier1 for h in by.values() if h.tier1)
            summary.append(f"{case.name}: {tier} SLO attainment "
                           + ", ".join(f"{p} {v:.0%}" for p, v in slo.items()))
    columns = ("scenario", "policy", "victim", "victim p99 TTFT flood/quiet",
               "Jain's index", "tier 1", "tier-1 p99 TTFT ms", "tier-1 SLO attainment",
               "tokens/s", "throughput vs passthrough")
    notes = [
        f"Each row is one fresh stack (deploy/stacks/noisy-neighbour.yaml: 2 emulated "
        f"h100-llama3-8b engines x 32 sequences, step budget 512, 1,024 KV blocks, priority "
        f"scheduling; no admission section: every admission setting derived from the "
        f"engines) and one headless Locust run with --stretch {stretch} --seed 1; only "
        f"`scheduler` changes.",
        *[f"{c.name}: {c.why}." for c in CASES],
        "victim: the run's tenant with the fewest requests (the report's isolation "
        "section); flood/quiet: its p99 TTFT in the flood phase (or the busiest) over the "
        "quiet phase (or the calmest); — when the scenario has one loaded phase (bimodal).",
        "Jain's index is over the tenants of a tier backlogged together (waiting for a first "
        "token) in 2 s windows, worst tier; — when no two were.",
        "tier 1: the best-ranked tier with requests; its SLO is the run's (interactive: "
        "TTFT <= 500 ms; standard: end to end <= 10 s).",
        "tokens/s: prompt + output tokens served per second of the run; relative to "
        "passthrough in the same scenario of this benchmark run.",
        "The machine runs engines, sidecar and generator on 2 shared cores: tail latencies "
        "are partly CPU contention; compare rows of one run, not runs.",
    ]
    return BenchResult(summary=summary, tables=[Table(columns, rows)], notes=notes,
                       passed=None)


BENCHMARK = Benchmark(
    name="scheduling_quality",
    title="sidecar policies on noisy_neighbour, tiers and bimodal (emulated engines); the "
          "seeds' scheduling claims (virtual time)",
    run=run,
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduling_quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", "policies", "claims"], default="all")
    parser.add_argument("--save", type=Path, default=None,
                        help="--part claims: keep the claims' result in this JSON file")
    parser.add_argument("--claims-from", type=Path, default=None,
                        help="--part all: the claims' result saved by --save (run them apart, "
                             "niced, and only the live policies under the benchmark lock)")
    parser.add_argument("--record", action="store_true",
                        help="write the section into benchmarks/RESULTS.md (--part all)")
    args = parser.parse_args(argv)
    if args.record and args.part != "all":
        parser.error("--record writes the whole section: --part all")
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.scheduling_quality",
                                         *argv])

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    claims: tuple[list[str], list[Table]] | None = None
    if args.claims_from is not None:
        saved = json.loads(args.claims_from.read_text())
        claims = (saved["summary"], [Table(tuple(t["columns"]), [tuple(r) for r in t["rows"]],
                                           t["caption"]) for t in saved["tables"]])
    if args.part == "claims":
        summary, tables = run_claims(log)
        if args.save is not None:
            args.save.write_text(json.dumps({"summary": summary, "tables": [
                {"columns": t.columns, "rows": t.rows, "caption": t.caption}
                for t in tables]}))
        result = BenchResult(summary=summary, tables=tables, notes=CLAIMS_NOTES)
    else:
        with Progress(console=Console(stderr=True)) as progress:
            ctx = BenchContext(progress=progress, quick=False)
            result = run_policies(ctx)
        if args.part == "all":
            summary, tables = claims if claims is not None else run_claims(log)
            result = BenchResult(summary=result.summary + summary,
                                 tables=result.tables + tables,
                                 notes=result.notes + CLAIMS_NOTES, passed=None)
    standalone.finish(BENCHMARK, result, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
