"""Service-normalised cost (issue 41, point 6): is DRR fairer in engine time, without losing
throughput, when a token is charged what it costs the engine? In virtual time.

A token costs 1 in DRR whatever it costs the engine: a prompt token is computed with
thousands of others in one step, an output token takes a step of its own, and attention
grows with the context. ``scheduler.service_cost`` (``sidecar/service_cost.py``, decision
0026) charges each token its (endpoint, model, prompt-length band)'s engine seconds per
computed token over the mean's, learned from each completed request's share of its
engine's time.

Workload, through the sidecar's SchedulingCore in front of one emulated h100-llama3-8b
engine (32 sequences, step budget 2,048, 4,096 blocks of 16; the claim engine of
benchmarks/scheduling_quality.py), two tenants of one tier and one weight, each a closed
loop of 48 users, backlogged at the sidecar: ``chat``, 128-token prompts and 384-token
answers (decode-heavy), and ``rag``, 6,000-token prompts and 32-token answers
(prefill-heavy, long context). Arms: ``service_cost`` off (the default) and on.

Engine time is the ground truth of the step model (emulator/profiles.py): each step's
duration is split over its sequences in proportion to each one's own terms (prefill tokens
and their attention to the context before them, or one decode, plus its KV read); steps are
taken one by one (``Simulation(coast=False)``). Per arm, over the window: each tenant's
engine seconds per second and tokens per second, Jain's index over engine time and over
tokens, and the engine's total tokens per second (computed prompt + output).

``python -m benchmarks.service_cost [--record]``
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from benchmarks import _results
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.drr_turns import jain
from benchmarks.scheduling_quality import (
    CLAIM_SEEDS,
    CLAIM_WARMUP_S,
    CLAIM_WINDOW_S,
    _lengths,
    claim_run,
)
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.engine import StepResult
from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.tenants import TenantSpec

TENANTS = {"chat": (128, 384), "rag": (6000, 32)}  # prompt, output tokens
ARMS = {"off (default)": False, "on": True}
WINDOW = (CLAIM_WARMUP_S, CLAIM_WARMUP_S + CLAIM_WINDOW_S)


class EngineTime(SimEngine):
    """A SimEngine that splits each step's duration in the window over its sequences, by
    each one's own terms of the step model, and adds it to the sequence's request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: Counter[str] = Counter()  # request id -> engine seconds
        self.tokens: Counter[str] = Counter()  # request id -> tokens computed in the window

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        batch = self.batch
        if batch is not None and batch.scheduled and WINDOW[0] <= end_s < WINDOW[1]:
            p = self.model.profile
            terms = {}
            for seq, n in batch.scheduled.items():
                context = seq.num_computed_tokens
                own = (p.t_decode_seq if n == 1 and context >= seq.prompt_tokens
                       else p.t_prefill_token * n + p.t_prefill_context * n * context)
                terms[seq.request_id] = own + p.t_kv_token * (context + n)
                self.tokens[seq.request_id] += n
            total = sum(terms.values())
            for rid, own in terms.items():
                self.seconds[rid] += batch.duration_s * own / total
        return super().advance(end_s)


class StepByStep(Simulation):
    """Every step its own event, so ``EngineTime`` sees each one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "coast": False})


def tenants() -> list[TenantSpec]:
    return [TenantSpec(name=name, api_key=f"sk-{name}", tier="shared", endpoint="chat",
                       arrival=Closed(users=48), lengths=_lengths(prompt, output))
            for name, (prompt, output) in TENANTS.items()]


def sidecar(on: bool) -> dict[str, Any]:
    return {"tiers": {"shared": {"rank": 1}},
            "tenants": {t.name: {"tier": "shared", "api_keys": [f"plain:{t.api_key}"],
                                 "limits": {"max_queued": 1000}} for t in tenants()},
            "scheduler": {"service_cost": on}}


def run_arm(label: str, on: bool) -> tuple[tuple[str, ...], str]:
    seconds: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for seed in CLAIM_SEEDS:
        sim = claim_run(sidecar(on), tenants(), seed, simulation=StepByStep,
                        engine_type=EngineTime)
        tenant_of = {r.request_id: r.tenant for r in sim.records}
        for engine in sim.engines:
            assert isinstance(engine, EngineTime)
            for rid, s in engine.seconds.items():
                seconds[tenant_of.get(rid, "?")] += s
            for rid, n in engine.tokens.items():
                tokens[tenant_of.get(rid, "?")] += n
    per_s = len(CLAIM_SEEDS) * CLAIM_WINDOW_S
    names = list(TENANTS)
    engine_share = [seconds[n] / per_s for n in names]
    token_rate = [tokens[n] / per_s for n in names]
    row = (label, " / ".join(f"{v:.3f}" for v in engine_share),
           f"{jain(engine_share):.3f}", " / ".join(f"{v:,.0f}" for v in token_rate),
           f"{jain(token_rate):.3f}", f"{sum(token_rate):,.0f}")
    line = (f"service_cost {label}: engine time chat / rag "
            f"{' / '.join(f'{v:.2f}' for v in engine_share)} (Jain {jain(engine_share):.3f}), "
            f"tokens/s {' / '.join(f'{v:,.0f}' for v in token_rate)}, total "
            f"{sum(token_rate):,.0f}")
    return row, line


def run_all(log: Any) -> BenchResult:
    rows, lines = [], []
    for label, on in ARMS.items():
        row, line = run_arm(label, on)
        rows.append(row)
        lines.append(line)
        log(line)
    table = Table(("service_cost", "engine s/s chat / rag", "Jain's index (engine time)",
                   "tokens/s chat / rag", "Jain's index (tokens)", "engine tokens/s"), rows,
                  caption="**service-normalised cost**: a decode-heavy and a prefill-heavy "
                          "tenant, backlogged, one engine")
    notes = [" ".join(__doc__.split("\n\n")[i].split()) for i in (1, 2, 3)] + [
        f"Virtual time, seeds {', '.join(map(str, CLAIM_SEEDS))} pooled; steps ending in "
        f"[{WINDOW[0]:g}, {WINDOW[1]:g}) s; per second of the window, per seed."]
    return BenchResult(summary=lines, tables=[table], notes=notes)


def run(ctx: BenchContext) -> BenchResult:
    return run_all(ctx.log)


BENCHMARK = Benchmark("service_cost", "service-normalised DRR cost: fairness in engine time "
                      "(virtual time)", run)


def main(argv: list[str] | None = None) -> int:
    return _results.standalone_main("service_cost", BENCHMARK, run_all, __doc__.splitlines()[0],
                                    argv)


if __name__ == "__main__":
    sys.exit(main())
