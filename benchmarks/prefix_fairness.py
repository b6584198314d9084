"""Fairness in computed tokens, in virtual time (issue 30's second acceptance): two tenants of
equal weight, both backlogged, one whose prompts are 90% a prefix the engine holds, one
prefix-free; Jain's index over the tokens the engine computed for each.

Both tenants send 1,000-token prompts for 64 output tokens (``ignore_eos``), closed loop,
``USERS`` users each (3x the engine's slots, so both stay backlogged at the sidecar). The
cached tenant's prompts are a 900-token system prompt, the same in every request (as a
history resent each turn), and 100 new tokens: the engine computes 100 + 64 of each (the
prompt's last partial block too: 104 + 64). The other's prompts share nothing: 1,000 + 64
computed. One engine, ``h100-llama3-8b``, 32 sequences, a 512-token step budget, prefill
chunks of at most 128 tokens, blocks of 16, KV for every sequence at full length (no
preemption, so nothing is computed twice). The sidecar: DRR, the two tenants in one tier.

Arms, the same traffic and engine:

``computed``  the engine reports ``usage.prompt_tokens_details.cached_tokens``
              (``--enable-prompt-tokens-details``): DRR charges the tokens it computes
              (the predicted uncached prompt, settled with the reported one).
``full``      the engine does not report them: the sidecar falls back to counting every
              prompt token, as it did before it knew of prefix caches (sidecar.core's
              ``unreported``): in the DRR charge, the prefill pacing and the router's load.
              The engine still caches: only the sidecar's counting differs.

Per arm: over requests the engine finished in [10 s, 40 s) of virtual time, the tokens it
computed for each tenant (prompt less cached, plus output, from the engine's own sequences)
and Jain's index over the two (weighbridge.statistics.jain_index); also each tenant's
requests and output. Target: the ``computed`` arm's index >= 0.95. Virtual time: the figures
are the scheduler's and the engine model's, the same on every run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.engine import StepResult
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import SystemPrompt, TenantSpec
from weighbridge.sidecar.config import parse_config
from weighbridge.statistics import jain_index

PROMPT, SYSTEM, OUTPUT = 1000, 900, 64
SLOTS = 32
USERS = 3 * SLOTS
WARMUP_S, WINDOW_S = 10.0, 30.0
TARGET = 0.95
SEED = 0
TENANTS = ("cached", "prefix-free")


class _CountingEngine(SimEngine):
    """A SimEngine that notes, for each request it finishes, when and the tokens it computed."""

    def __init__(self, name: str, options: EmulatorOptions) -> None:
        super().__init__(name, options)
        self.computed: dict[str, tuple[float, int, int]] = {}  # id -> (end, prompt, output)

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        out = super().advance(end_s)
        for seq in out[0].finished:
            self.computed[seq.request_id] = (end_s, seq.prompt_tokens - seq.num_cached_tokens,
                                             seq.output_tokens)
        return out


def engine_options(reports_cached: bool) -> EmulatorOptions:
    blocks = SLOTS * -(-(PROMPT + OUTPUT) // 16)
    return EmulatorOptions(profile="h100-llama3-8b", max_num_seqs=SLOTS,
                           max_num_batched_tokens=512, long_prefill_token_threshold=128,
                           num_kv_blocks=blocks, block_size=16, max_model_len=2048,
                           enable_prompt_tokens_details=reports_cached)


def workload(until_s: float) -> Workload:
    lengths = Lengths.model_validate({"prompt": PROMPT - SYSTEM, "output": OUTPUT})
    cached = TenantSpec(name="cached", api_key="sk-cached", tier="shared", lengths=lengths,
                        system_prompt=SystemPrompt.model_validate({"length": SYSTEM}),
                        arrival=Closed(users=USERS))
    free = TenantSpec(name="prefix-free", api_key="sk-free", tier="shared",
                      lengths=Lengths.model_validate({"prompt": PROMPT, "output": OUTPUT}),
                      arrival=Closed(users=USERS))
    return Workload(scenario="prefix-fairness", phases=(PhaseSpan("backlog", 0, until_s),),
                    tenants=(cached, free))


@dataclass(frozen=True)
class ArmFigures:
    name: str
    computed: dict[str, int]  # tenant -> tokens the engine computed in the window
    prompt_computed: dict[str, int]
    requests: dict[str, int]
    output: dict[str, int]
    jain: float

    def share(self, tenant: str) -> float:
        total = sum(self.computed.values())
        return self.computed[tenant] / total if total else 0.0


def run_arm(name: str, reports_cached: bool) -> ArmFigures:
    until = WARMUP_S + WINDOW_S
    config = parse_config({
        "tiers": {"shared": {"rank": 1}},
        "tenants": {"cached": {"tier": "shared", "api_keys": ["plain:sk-cached"]},
                    "prefix-free": {"tier": "shared", "api_keys": ["plain:sk-free"]}},
        "scheduler": {"policy": "drr"},
        "admission": {"step_budget_tokens": 512},
        "backends": [{"name": "engine-0", "url": "http://127.0.0.1:9"}],
    })
    engine = _CountingEngine("engine-0", engine_options(reports_cached))
    sim = Simulation(config, [engine], WorkloadClients(workload(until), seed=SEED,
                                                       until_s=until),
                     run_id=f"prefix-fairness-{name}", scenario="prefix-fairness",
                     until_s=until)
    result = sim.run()
    tenant_of = {r.request_id: r.tenant for r in result.records}
    computed: Counter[str] = Counter()
    prompt: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    output: Counter[str] = Counter()
    for request_id, (end_s, prompt_tokens, output_tokens) in engine.computed.items():
        tenant = tenant_of.get(request_id)
        if tenant is None or not WARMUP_S <= end_s < until:
            continue
        computed[tenant] += prompt_tokens + output_tokens
        prompt[tenant] += prompt_tokens
        requests[tenant] += 1
        output[tenant] += output_tokens
    jain = jain_index([float(computed[t]) for t in TENANTS]) or 0.0
    return ArmFigures(name, {t: computed[t] for t in TENANTS},
                      {t: prompt[t] for t in TENANTS}, {t: requests[t] for t in TENANTS},
                      {t: output[t] for t in TENANTS}, jain)


def run(ctx: BenchContext) -> BenchResult:
    arms = []
    for name, reports in (("computed", True), ("full", False)):
        ctx.log(f"  {name} charging ...")
        arms.append(run_arm(name, reports))
    computed, full = arms
    rows = [(a.name, t, f"{a.requests[t]:,}", f"{a.prompt_computed[t]:,}", f"{a.output[t]:,}",
             f"{a.computed[t]:,}", f"{a.share(t):.3f}", f"{a.jain:.3f}")
            for a in arms for t in TENANTS]
    table = Table(("charge", "tenant", "requests finished", "prompt tokens computed",
                   "output tokens", "tokens computed", "share of computed", "Jain's index"),
                  rows)
    passed = computed.jain >= TARGET
    summary = [
        f"Charged in computed tokens: Jain's index over the tokens the engine computed for "
        f"each tenant **{computed.jain:.3f}** (target >= {TARGET}: "
        f"{'met' if passed else 'MISSED'}); the cached tenant's share "
        f"{computed.share('cached'):.3f}, with {computed.requests['cached']:,} requests "
        f"finished against the prefix-free tenant's {computed.requests['prefix-free']:,}.",
        f"Charged every prompt token (the engine not reporting cached tokens): Jain's index "
        f"**{full.jain:.3f}**, the cached tenant's share {full.share('cached'):.3f}, with "
        f"{full.requests['cached']:,} requests against {full.requests['prefix-free']:,}: "
        "charged and paced for prefill the engine skips, the cached tenant gets half the "
        "other's share of the engine's work (the prefill pacing, counting each of its prompts "
        "whole, lets it one prompt into prefill at a time).",
    ]
    return BenchResult(
        summary=summary, tables=[table],
        setup=[f"one engine: h100-llama3-8b, {SLOTS} seqs, budget 512, prefill chunks <= 128, "
               "blocks of 16, KV for every sequence; sidecar: DRR, two tenants of weight 1",
               f"traffic: {USERS} closed-loop users per tenant, {PROMPT} + {OUTPUT} tokens; the "
               f"cached tenant's first {SYSTEM} the same in every request",
               "virtual time (weighbridge.app.simulation): deterministic; the machine's load does "
               "not enter the figures"],
        notes=[__doc__.split("\n\n")[2].replace("\n", " ")],
        passed=passed)


BENCHMARK = Benchmark(
    name="prefix_fairness",
    title="fairness in computed tokens: a cached tenant beside a prefix-free one (virtual time)",
    run=run,
)
