"""Agent programs on 4 emulated engines, in virtual time: ``program_las`` (least attained
service per program inside a tenant) against today's per-request orderings, the default
``shortest_prompt_first`` and ``fifo``, DRR across tenants in all (issue 40's first two
acceptance points, in virtual time).

The engines are ``deploy/stacks/agent-programs.yaml``'s (``h100-llama3-8b``, 64 sequences,
4,096 KV blocks of 16 tokens, the prefix cache on and reporting cached tokens). The traffic
is two tenants of equal weight whose tasks are agent programs of the same shape: a number
of calls drawn heavy-tailed (lognormal, median 5, 2 to 40), each resending the program's
growing context behind the tenant's shared system prompt, a tool run between calls
(median 0.8 s), and subagents forked after one call in ten (2-3 of 2-4 calls, joined
back). ``alpha`` names its programs as Claude Code and vllm-router's agentic context do,
``beta`` as OpenCode does. Programs start for ``PROGRAMS_S`` and the run goes on until every
one has ended, so completion times are of every program, not of the survivors.

Arms:

(a) **Equal tenants.** Both tenants at ``SCALES`` x 1 program/s each (the acceptance scale
    ``ACCEPTANCE_SCALE`` has the sidecar's queue full for the whole arrival phase: the
    backlog drains for minutes after it), ``fifo`` and ``shortest_prompt_first`` against
    ``program_las``. Program
    completion p50/p90 over both tenants' programs (start: the root's first call's
    scheduled send; end: the end of its last call), output tokens (every token of the
    run), Jain's index over the tenants' computed tokens (output, and the prompt the prefix
    cache did not answer).
(b) **A tenant with 10x the programs.** ``small`` (alpha's shape, ``SMALL_RATE`` programs/s)
    beside ``big`` (beta's shape, 10x the rate), ``program_las``; against ``small`` alone on
    half the engines (its share of two equal-weight tenants), and alone on all four.

Targets (issue 40): (a) p50 and p90 at most 0.7x the default ordering's
(``shortest_prompt_first``; fifo's beside it), output at least 0.98x, Jain at least 0.95;
(b) small's p90 at most 1.2x its p90 alone at its share.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.loop import Simulation
from weighbridge.app.simulation.run import engines_for, sidecar_for
from weighbridge.app.stack import StackSpec, load_stack, parse_stack
from weighbridge.loadgen.scenario import Phase, Scenario
from weighbridge.records import RequestRecord
from weighbridge.resources import DEPLOY_DIR
from weighbridge.statistics import jain_index, percentile

SEED = 0
VIRTUAL = "virtual time (weighbridge.app.simulation): deterministic"
PROGRAMS_S = 60.0  # programs start for this long
DRAIN_S = 600.0  # then none start; every program ends well before
SCALES = (5.0, 6.0)
ACCEPTANCE_SCALE = 6.0
SMALL_RATE = 1.0  # programs/s of the small tenant in (b); the big one sends 10x
TARGET_COMPLETION, TARGET_OUTPUT, TARGET_JAIN, TARGET_SMALL = 0.7, 0.98, 0.95, 1.2
DEFAULT = "shortest_prompt_first"  # scheduler.ordering's default: today's per-request order
ORDERINGS = ("fifo", DEFAULT, "program_las")


def program_shape(name: str, key: str, identity: list[str], rate: float) -> dict[str, Any]:
    """One tenant of agent programs (module doc), in the tenants file's form."""
    return {
        "name": name, "api_key": key, "tier": "standard", "endpoint": "chat", "users": 50,
        "system_prompt": {"length": {"kind": "uniform", "low": 1200, "high": 1600},
                          "shared": f"{name}-agent"},
        "programs": {
            "calls": {"kind": "lognormal", "median": 5, "sigma": 1.0, "low": 2, "high": 40},
            "tool_ms": {"kind": "lognormal", "median": 800, "sigma": 0.8, "low": 50,
                        "high": 8000},
            "tool_output": {"kind": "lognormal", "median": 150, "sigma": 0.9, "low": 10,
                            "high": 600},
            "subagents": {"probability": 0.1, "count": {"kind": "uniform", "low": 2, "high": 3},
                          "calls": {"kind": "uniform", "low": 2, "high": 4}},
        },
        "lengths": {"prompt": {"kind": "uniform", "low": 60, "high": 200},
                    "output": {"kind": "lognormal", "median": 80, "sigma": 0.6, "low": 8,
                               "high": 256}},
        "arrival": {"kind": "poisson", "rate": rate},
        "phases": {"drain": None},
        "identity": identity,
    }


ALPHA = ("sk-alpha", ["claude_code", "agentic_context"])
BETA = ("sk-beta", ["opencode"])


@dataclass(frozen=True)
class Arm:
    name: str
    programs: dict[str, list[float]]  # completion times of each tenant's programs, seconds
    started: int
    output_tokens: int
    computed: dict[str, int]  # per tenant
    hit_rate: float
    last_end_s: float
    # Programs not ended when the run did (a live run's end): their wait so far, a lower
    # bound of their completion, counted in the percentiles so the slowest are not left out.
    unfinished: dict[str, list[float]] = field(default_factory=dict)
    failed: int = 0  # programs a call of which failed: in no percentile

    def completion(self, tenant: str | None = None) -> list[float]:
        sets = [self.programs, self.unfinished]
        values = ([v for one in sets for v in one.get(tenant, [])] if tenant is not None
                  else [v for one in sets for vs in one.values() for v in vs])
        return sorted(values)

    def open_programs(self, tenant: str | None = None) -> int:
        return sum(len(vs) for t, vs in self.unfinished.items() if tenant in (None, t))

    def p(self, q: float, tenant: str | None = None) -> float:
        return percentile(self.completion(tenant), q)

    @property
    def completed(self) -> int:
        return len(self.completion()) - self.open_programs()

    @property
    def jain(self) -> float:
        return jain_index(list(self.computed.values())) or 1.0


def stack(ordering: str, tenants: list[str], engines: int = 4) -> StackSpec:
    data = load_stack(DEPLOY_DIR / "stacks" / "agent-programs.yaml").model_dump()
    data["engines"]["count"] = engines
    keys = {"alpha": ALPHA[0], "beta": BETA[0], "small": ALPHA[0], "big": BETA[0]}
    data["sidecar"]["tenants"] = {name: {"tier": "standard",
                                         "api_keys": [f"plain:{keys[name]}"]}
                                  for name in tenants}
    data["sidecar"]["scheduler"] = {"policy": "drr", "ordering": ordering}
    return parse_stack(data, source=f"agent-programs ({ordering}, {engines} engines)")


def measure(name: str, records: list[RequestRecord]) -> Arm:
    start: dict[tuple[str, str], float] = {}
    end: dict[tuple[str, str], float] = {}
    failed: set[tuple[str, str]] = set()
    computed: dict[str, int] = {}
    for r in records:
        computed[r.tenant] = computed.get(r.tenant, 0) + (r.output_tokens or 0) + max(
            0, (r.prompt_tokens or 0) - (r.cached_tokens or 0))
        if r.program_id is None or r.parent_program_id is not None:
            continue
        key = (r.tenant, r.program_id)
        start[key] = min(start.get(key, r.scheduled_s), r.scheduled_s)
        if r.program_end == "completed":  # the one rule (weighbridge.records)
            end[key] = r.end_s
        elif r.program_end == "failed":
            failed.add(key)
    programs: dict[str, list[float]] = {}
    for key, e in end.items():
        programs.setdefault(key[0], []).append(e - start[key])
    last_end_s = max((r.end_s for r in records), default=0.0)
    unfinished: dict[str, list[float]] = {}
    for key, began in start.items():
        if key not in end and key not in failed:
            unfinished.setdefault(key[0], []).append(last_end_s - began)
    prompt = sum(r.prompt_tokens or 0 for r in records)
    return Arm(name=name, programs=programs, started=len(start),
               output_tokens=sum(r.output_tokens or 0 for r in records), computed=computed,
               hit_rate=sum(r.cached_tokens or 0 for r in records) / prompt if prompt else 0.0,
               last_end_s=last_end_s, unfinished=unfinished, failed=len(failed))


def run_arm(name: str, ordering: str, tenants: list[dict[str, Any]], scale: float,
            engines: int = 4) -> Arm:
    st = stack(ordering, [t["name"] for t in tenants], engines)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        path.write_text(yaml.safe_dump({"tenants": tenants}))
        scenario = Scenario(name="program_ordering", description=name,
                            phases=(Phase("programs", PROGRAMS_S), Phase("drain", DRAIN_S)),
                            tenants_file=path)
        workload = scenario.workload(tenants_file=path, scale=scale)
    until = PROGRAMS_S + DRAIN_S
    sim = Simulation(sidecar_for(st), engines_for(st), WorkloadClients(workload, SEED, until),
                     run_id=f"program-ordering-{name}", scenario="program_ordering",
                     until_s=until, drain=True)
    result = sim.run()
    return measure(name, result.records)


def _s(x: float) -> str:
    return f"{x:,.1f}"


Runner = Callable[[str, str, list[dict[str, Any]], float, int], Arm]


def run(ctx: BenchContext) -> BenchResult:
    scales = (ACCEPTANCE_SCALE,) if ctx.quick else SCALES
    return compare(run_arm, scales, ctx.log)


def compare(runner: Runner, scales: Sequence[float], log: Callable[[str], None],
            references: bool = True, setting: str = VIRTUAL) -> BenchResult:
    """Arms (a) at ``scales`` and (b), each run by ``runner`` (``run_arm``'s signature):
    in virtual time, or live. Without ``references``, (b) runs the two arms its target
    compares, leaving out fifo beside the big tenant and the small one alone on four
    engines."""
    equal = [program_shape("alpha", ALPHA[0], ALPHA[1], 1.0),
             program_shape("beta", BETA[0], BETA[1], 1.0)]
    rows: list[tuple[str, ...]] = []
    by_scale: dict[float, dict[str, Arm]] = {}
    for scale in scales:
        arms = {}
        for ordering in ORDERINGS:
            log(f"  (a) scale {scale:g}: {ordering} ...")
            arms[ordering] = runner(f"{ordering} x{scale:g}", ordering, equal, scale, 4)
        by_scale[scale] = arms
        fifo, default = arms["fifo"], arms[DEFAULT]
        for ordering, arm in arms.items():
            rows.append((f"{scale:g}", ordering, f"{arm.started:,}", f"{arm.completed:,}",
                         _s(arm.p(0.5)), _s(arm.p(0.9)),
                         f"{arm.p(0.5) / default.p(0.5):.2f} / "
                         f"{arm.p(0.9) / default.p(0.9):.2f}",
                         f"{arm.p(0.5) / fifo.p(0.5):.2f} / {arm.p(0.9) / fifo.p(0.9):.2f}",
                         " · ".join(f"{t} {_s(arm.p(0.5, t))}/{_s(arm.p(0.9, t))}"
                                    for t in ("alpha", "beta")),
                         f"{arm.output_tokens:,}",
                         f"{arm.output_tokens / default.output_tokens:.3f}",
                         f"{arm.jain:.3f}", f"{arm.hit_rate:.3f}", _s(arm.last_end_s)))
    equal_table = Table(("scale", "ordering", "programs", "completed", "p50 s", "p90 s",
                         f"over {DEFAULT} p50 / p90", "over fifo p50 / p90",
                         "per tenant p50/p90 s", "output tokens", f"over {DEFAULT}",
                         "Jain (computed)", "hit rate", "last end s"), rows)

    small = program_shape("small", ALPHA[0], ALPHA[1], SMALL_RATE)
    big = program_shape("big", BETA[0], BETA[1], 10 * SMALL_RATE)
    log("  (b) small beside big (10x), program_las ...")
    crowd = runner("small+big", "program_las", [small, big], 1.0, 4)
    log("  (b) small alone on 2 engines (its share) ...")
    share = runner("small alone, 2 engines", "program_las", [small], 1.0, 2)
    others: list[Arm] = []
    if references:
        log("  (b) small alone on 4 engines ...")
        others.append(runner("small alone, 4 engines", "program_las", [small], 1.0, 4))
        log("  (b) small beside big, fifo (for reference) ...")
        others.append(runner("small+big fifo", "fifo", [small, big], 1.0, 4))
    small_rows: list[tuple[str, ...]] = [
        (arm.name, f"{len(arm.completion('small')):,}", _s(arm.p(0.5, "small")),
         _s(arm.p(0.9, "small")), f"{arm.p(0.9, 'small') / share.p(0.9, 'small'):.2f}",
         _s(arm.p(0.9, "big")) if arm.completion("big") else "—", f"{arm.jain:.3f}")
        for arm in (crowd, *others[1:], share, *others[:1])]
    small_table = Table(("arm", "small's programs", "small p50 s", "small p90 s",
                         "p90 over alone at its share", "big p90 s", "Jain (computed)"),
                        small_rows)

    acc = by_scale[ACCEPTANCE_SCALE]
    fifo, base, las = acc["fifo"], acc[DEFAULT], acc["program_las"]
    r50, r90 = las.p(0.5) / base.p(0.5), las.p(0.9) / base.p(0.9)
    out = las.output_tokens / base.output_tokens
    small_ratio = crowd.p(0.9, "small") / share.p(0.9, "small")
    checks = {"p50": r50 <= TARGET_COMPLETION, "p90": r90 <= TARGET_COMPLETION,
              "output": out >= TARGET_OUTPUT, "jain": las.jain >= TARGET_JAIN,
              "small": small_ratio <= TARGET_SMALL}

    def verdict(name: str) -> str:
        return "met" if checks[name] else "MISSED"

    summary = [
        f"(a) Two equal tenants at scale {ACCEPTANCE_SCALE:g}: program_las's program "
        f"completion p50 **{r50:.2f}x** the default {DEFAULT}'s ({_s(las.p(0.5))} vs "
        f"{_s(base.p(0.5))} s; target <= {TARGET_COMPLETION}: {verdict('p50')}), p90 "
        f"**{r90:.2f}x** ({_s(las.p(0.9))} vs {_s(base.p(0.9))} s; {verdict('p90')}); "
        f"against fifo p50 {las.p(0.5) / fifo.p(0.5):.2f}x, p90 "
        f"{las.p(0.9) / fifo.p(0.9):.2f}x; output **{out:.3f}x** (>= {TARGET_OUTPUT}: "
        f"{verdict('output')}); Jain over the tenants' computed tokens **{las.jain:.3f}** "
        f"(>= {TARGET_JAIN}: {verdict('jain')}).",
        f"(b) small beside big (10x its programs): small's p90 **{small_ratio:.2f}x** its p90 "
        f"alone on its share of the engines ({_s(crowd.p(0.9, 'small'))} vs "
        f"{_s(share.p(0.9, 'small'))} s; target <= {TARGET_SMALL}: {verdict('small')})"
        + "".join(f"; {crowd.p(0.9, 'small') / alone.p(0.9, 'small'):.2f}x its p90 alone on "
                  "all four" for alone in others[:1]) + ".",
        "Least attained service shortens the short programs (the median) and leaves the "
        "long ones where FIFO had them: the p90 programs are the long ones, whose calls "
        "wait behind the newer programs' up to the aging bound (30 s).",
    ]
    return BenchResult(
        summary=summary, tables=[equal_table, small_table],
        setup=["engines: 4 x agent-programs.yaml's (h100-llama3-8b, 64 seqs, budget 2,048, "
               "4,096 blocks of 16, prefix cache on); (b)'s share arm: 2 of them",
               f"traffic: module doc, seed {SEED}, programs start for {PROGRAMS_S:g} s; "
               f"(a) at --scale {', '.join(f'{s:g}' for s in scales)}; (b) small "
               f"{SMALL_RATE:g}/s, big {10 * SMALL_RATE:g}/s",
               setting],
        notes=[" ".join(__doc__.split("\n\n")[1].split()),
               "Why (b) misses: small's calls never wait in the sidecar (DRR serves it "
               "first, its queue time 0 at p90) but run on engines the big tenant fills, "
               "in batches of up to 64 sequences and with its contexts evicted from the "
               "prefix cache (hit rate 0.72 against 0.94 alone), so each call takes about "
               "3x as long: an isolation limit of the engines' batch and cache, not of "
               "the order of the sidecar's queue (measured per call with "
               "benchmarks.program_ordering.run_arm, 2026-12-07)."],
        passed=all(checks.values()))


BENCHMARK = Benchmark(
    name="program_ordering",
    title="agent programs on 4 engines: program_las vs per-request fifo, and a tenant with "
          "10x the programs (virtual time)",
    run=run,
)
