"""The peer benchmark's figures (benchmarks/peer_router.py), without I/O: what a run of
``vllm bench serve`` saved, the engines' counters over a window, one arm's run, the medians
over repeats, the ratios to the peer's ``cache_aware`` and issue 38's acceptance checks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks import _prom
from benchmarks._core import Table
from weighbridge.statistics import percentile

ARMS = ("cache_aware", "round_robin", "weighbridge")
BASELINE = "cache_aware"  # vllm-router's default policy: every ratio is against it
SERVE_WORKLOADS = ("prefix_repetition", "random")  # vllm bench serve's datasets
WORKLOADS = (*SERVE_WORKLOADS, "chat_sessions", "flood")
OURS = "weighbridge"
# The flood's floor: the victim alone (no flood) through weighbridge, on engines with the
# prefix cache off, so every turn computes its whole history, as when a flood's block
# allocations evict the victim's sessions between its turns.
CACHE_LOST = "cache_lost"
FLOOD_ARMS = (*ARMS, CACHE_LOST)
# The flooded victim's p90 over that floor, at most: the target this benchmark proposes for
# engines whose cache cannot hold the victim's sessions through a flood (RESULTS.md, issue
# 38's hand section); the scheduler's own cost on top of the lost cache.
OVER_CACHE_LOST = 1.2

# The engines' counters a window reads (vLLM's names): the prefix cache's and the output's.
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"  # sequences evicted for KV and recomputed
# The emulator's own: how far its steps ran behind its model (a CPU-starved engine lags).
STEP_LAG = "weighbridge_emulator_step_lag_seconds"
# The sidecar's prefix index judged by the engines: cached prompt tokens per backend, as it
# predicted them at dispatch and as the engine's answers reported them.
SIDECAR_CACHED = "weighbridge_backend_prefix_cached_tokens"
# The sidecar's dispatch attempts held by admission control, by backend and reason.
SIDECAR_HOLDS = "weighbridge_admission_holds"
# prefix_aware's choices of backend, by backend and reason (affinity, load, bounded).
SIDECAR_ROUTING = "weighbridge_routing_decisions"


@dataclass(frozen=True, slots=True)
class FleetCounters:
    """The engines' counters at one moment, summed over the fleet."""

    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    generation_tokens: float = 0.0
    step_lag_s: float = 0.0  # summed over steps
    steps: float = 0.0
    preemptions: float = 0.0

    def __sub__(self, other: FleetCounters) -> FleetCounters:
        return FleetCounters(self.prefix_hits - other.prefix_hits,
                             self.prefix_queries - other.prefix_queries,
                             self.generation_tokens - other.generation_tokens,
                             self.step_lag_s - other.step_lag_s, self.steps - other.steps,
                             self.preemptions - other.preemptions)

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix caches over those looked up (None: none were)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else None

    @property
    def computed_tokens(self) -> float:
        """The engines' work: prompt tokens not found cached, at their admission, and output
        tokens."""
        return self.prefix_queries - self.prefix_hits + self.generation_tokens

    @property
    def step_lag_ms(self) -> float | None:
        """The emulated engines' mean step lag (None: no step, or not an emulator)."""
        return self.step_lag_s / self.steps * 1e3 if self.steps > 0 else None


def fleet_counters(metrics_texts: Iterable[str]) -> FleetCounters:
    """The fleet's counters from each engine's /metrics text."""
    names = (PREFIX_HITS, PREFIX_QUERIES, GENERATION_TOKENS, STEP_LAG + "_sum",
             STEP_LAG + "_count", PREEMPTIONS)
    totals = [0.0] * len(names)
    for text in metrics_texts:
        samples = _prom.parse(text)
        for i, name in enumerate(names):
            totals[i] += _prom.total(samples, name)
    return FleetCounters(*totals)


def _series(metrics_text: str, family: str) -> Iterator[tuple[dict[str, str], float]]:
    """Each sample of counter ``family`` in a /metrics text: its labels and value."""
    for key, value in _prom.parse(metrics_text).items():
        name, _, labels = key.partition("{")
        if name in (family, family + "_total"):
            yield dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p), value


def holds_by_reason(metrics_text: str, family: str = SIDECAR_HOLDS) -> dict[str, float]:
    """From the sidecar's /metrics: its admission holds (or another counter ``family``
    labelled by reason) by reason, over every backend."""
    out: dict[str, float] = {}
    for fields, value in _series(metrics_text, family):
        reason = fields.get("reason", "?")
        out[reason] = out.get(reason, 0.0) + value
    return out


def cached_tokens_by_backend(metrics_text: str) -> dict[str, tuple[float, float]]:
    """From the sidecar's /metrics: per backend, (predicted, reported) cached prompt tokens."""
    out: dict[str, tuple[float, float]] = {}
    for fields, value in _series(metrics_text, SIDECAR_CACHED):
        predicted, reported = out.get(fields.get("backend", "?"), (0.0, 0.0))
        if fields.get("source") == "predicted":
            predicted += value
        elif fields.get("source") == "reported":
            reported += value
        out[fields.get("backend", "?")] = (predicted, reported)
    return out


@dataclass(frozen=True, slots=True)
class ServeResult:
    """What ``vllm bench serve --save-result`` wrote: its requests, its clock and its TTFT
    percentiles (asked for with ``--percentile-metrics ttft --metric-percentiles 50,90,99``)."""

    completed: int
    failed: int
    duration_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    output_tok_s: float  # the client's count of streamed tokens over its duration


def parse_serve_result(data: Mapping[str, Any]) -> ServeResult:
    """Read a result file's JSON (ValueError: not one, or without the TTFT percentiles)."""
    try:
        def ttft(q: int) -> float:
            # The median is always saved; the other percentiles only when asked for.
            key = "median_ttft_ms" if q == 50 and "p50_ttft_ms" not in data else f"p{q}_ttft_ms"
            return float(data[key]) / 1e3
        return ServeResult(completed=int(data["completed"]), failed=int(data.get("failed", 0)),
                           duration_s=float(data["duration"]), ttft_p50_s=ttft(50),
                           ttft_p90_s=ttft(90), ttft_p99_s=ttft(99),
                           output_tok_s=float(data.get("output_throughput", math.nan)))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a vllm bench serve result with TTFT p50/p90/p99: {error!r}") \
            from None


@dataclass(frozen=True, slots=True)
class Latency:
    """TTFT percentiles in seconds (NaN: no request)."""

    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan

    @classmethod
    def of(cls, ttfts: Iterable[float]) -> Latency:
        values = sorted(ttfts)
        if not values:
            return cls()
        return cls(*(percentile(values, q) for q in (0.5, 0.9, 0.99)))


@dataclass(slots=True)
class ArmRun:
    """One arm on one workload on fresh engines: what the client saw, what the engines
    counted over the window, and the router's CPU."""

    fleet: int
    workload: str
    arm: str
    repeat: int
    ok: int  # requests answered in full
    failed: int  # rejected, errors, timeouts
    ttft: Latency  # the flood: the victim's during the flood
    hit_rate: float | None  # engines' prefix hits over queries in the window
    output_tok_s: float  # engines' generated tokens over the window, per second
    router_cpu_s: float  # the router's process group over the run
    computed_tok_s: float = math.nan  # engines' uncached prompt and output tokens, per second
    step_lag_ms: float | None = None  # the emulated engines' mean step lag over the window
    victim_before: Latency | None = None  # the flood: the victim's before it
    flood_done_per_s: float | None = None  # the flood: its requests answered in full, per s
    # weighbridge: per backend, (predicted, reported) cached prompt tokens
    cached: dict[str, tuple[float, float]] = field(default_factory=dict)
    holds: dict[str, float] = field(default_factory=dict)  # weighbridge: by reason
    routing: dict[str, float] = field(default_factory=dict)  # weighbridge: by reason

    @property
    def cpu_per_request_s(self) -> float:
        return self.router_cpu_s / self.ok if self.ok else math.nan


@dataclass(frozen=True, slots=True)
class Figures:
    """One arm's medians over its repeats on one fleet and workload."""

    repeats: int
    ok: float
    failed: float
    p50: float
    p90: float
    p99: float
    hit_rate: float | None
    output_tok_s: float
    computed_tok_s: float
    cpu_per_request_s: float
    before_p50: float | None
    before_p90: float | None
    flood_done_per_s: float | None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else None


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def medians(runs: Iterable[ArmRun]) -> dict[tuple[int, str, str], Figures]:
    """Per (fleet, workload, arm): the medians over its repeats."""
    groups: dict[tuple[int, str, str], list[ArmRun]] = {}
    for run in runs:
        groups.setdefault((run.fleet, run.workload, run.arm), []).append(run)

    def med(group: list[ArmRun], get: Callable[[ArmRun], float | None]) -> float | None:
        return _median(get(r) for r in group)

    return {key: Figures(
        repeats=len(group),
        ok=_nan(med(group, lambda r: r.ok)), failed=_nan(med(group, lambda r: r.failed)),
        p50=_nan(med(group, lambda r: r.ttft.p50)), p90=_nan(med(group, lambda r: r.ttft.p90)),
        p99=_nan(med(group, lambda r: r.ttft.p99)),
        hit_rate=med(group, lambda r: r.hit_rate),
        output_tok_s=_nan(med(group, lambda r: r.output_tok_s)),
        computed_tok_s=_nan(med(group, lambda r: r.computed_tok_s)),
        cpu_per_request_s=_nan(med(group, lambda r: r.cpu_per_request_s)),
        before_p50=med(group, lambda r: r.victim_before.p50 if r.victim_before else None),
        before_p90=med(group, lambda r: r.victim_before.p90 if r.victim_before else None),
        flood_done_per_s=med(group, lambda r: r.flood_done_per_s))
        for key, group in groups.items()}


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value`` over ``baseline`` (None: either unknown, or a zero baseline)."""
    if value is None or baseline is None or math.isnan(value) or math.isnan(baseline) \
            or baseline == 0:
        return None
    return value / baseline


@dataclass(frozen=True, slots=True)
class Check:
    """One acceptance criterion of issue 38, judged on the medians."""

    fleet: int
    what: str
    value: float | None  # the measured ratio
    target: float
    at_most: bool  # True: value <= target passes; False: value >= target

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value <= self.target if self.at_most else self.value >= self.target

    def line(self) -> str:
        measured = "n/a" if self.value is None else f"{self.value:.2f}x"
        sign = "<=" if self.at_most else ">="
        return (f"{'pass' if self.passed else 'miss'}: {self.fleet} engines, {self.what}: "
                f"{measured} (target {sign} {self.target:g}x)")


def acceptance(figures: Mapping[tuple[int, str, str], Figures]) -> list[Check]:
    """Issue 38's acceptance on every fleet measured, for the workloads it names."""
    checks: list[Check] = []
    for fleet in sorted({key[0] for key in figures}):
        def get(workload: str, arm: str, fleet: int = fleet) -> Figures | None:
            return figures.get((fleet, workload, arm))

        ours, peer = get("flood", OURS), get("flood", BASELINE)
        if ours is not None and peer is not None:
            checks += [
                Check(fleet, "flood, engines' output over cache_aware's",
                      ratio(ours.output_tok_s, peer.output_tok_s), 0.95, at_most=False),
                Check(fleet, "flood, victim's TTFT p90 over cache_aware's",
                      ratio(ours.p90, peer.p90), 0.1, at_most=True),
                Check(fleet, "flood, victim's TTFT p90 over its own before the flood",
                      ratio(ours.p90, ours.before_p90), 2.0, at_most=True)]
        floor = get("flood", CACHE_LOST)
        if ours is not None and floor is not None:
            checks.append(Check(fleet, "flood, victim's TTFT p90 over the same victim's alone "
                                "with its cache lost", ratio(ours.p90, floor.p90),
                                OVER_CACHE_LOST, at_most=True))
        for workload in ("prefix_repetition", "chat_sessions"):
            ours, peer = get(workload, OURS), get(workload, BASELINE)
            if ours is None or peer is None:
                continue
            checks += [
                Check(fleet, f"{workload}, prefix-cache hit rate over cache_aware's",
                      ratio(ours.hit_rate, peer.hit_rate), 1.0, at_most=False),
                Check(fleet, f"{workload}, TTFT p50 over cache_aware's",
                      ratio(ours.p50, peer.p50), 1.0, at_most=True)]
    return checks


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:,.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ordered(figures: Mapping[tuple[int, str, str], Figures]) -> list[tuple[int, str, str]]:
    def order(key: tuple[int, str, str]) -> tuple[int, int, int]:
        fleet, workload, arm = key
        return (fleet, WORKLOADS.index(workload) if workload in WORKLOADS else 99,
                FLOOD_ARMS.index(arm) if arm in FLOOD_ARMS else 99)
    return sorted(figures, key=order)


def medians_table(figures: Mapping[tuple[int, str, str], Figures]) -> Table:
    """Per fleet, workload and arm: the medians, each beside its ratio to cache_aware's."""
    rows: list[tuple[str, ...]] = []
    for key in _ordered(figures):
        fleet, workload, arm = key
        f, base = figures[key], figures.get((fleet, workload, BASELINE))
        b = base if base is not None else f
        rows.append((
            str(fleet), workload, arm, str(f.repeats), f"{f.ok:,.0f}", f"{f.failed:,.0f}",
            f"{_rate(f.hit_rate)} ({_x(ratio(f.hit_rate, b.hit_rate))})",
            f"{_ms(f.p50)} ({_x(ratio(f.p50, b.p50))})",
            f"{_ms(f.p90)} ({_x(ratio(f.p90, b.p90))})",
            f"{_ms(f.p99)} ({_x(ratio(f.p99, b.p99))})",
            f"{f.output_tok_s:,.0f} ({_x(ratio(f.output_tok_s, b.output_tok_s))})",
            f"{f.cpu_per_request_s * 1e3:.2f} "
            f"({_x(ratio(f.cpu_per_request_s, b.cpu_per_request_s))})"))
    return Table(("engines", "workload", "arm", "repeats", "ok", "failed",
                  "engines' hit rate", "TTFT p50 ms", "p90 ms", "p99 ms",
                  "engines' output tok/s", "router CPU ms/request"), rows,
                 caption="**Medians over repeats** (in brackets: over vllm-router "
                         "cache_aware's; the flood's TTFT is the victim's during the flood, "
                         "its output and hit rate the engines' during the flood)")


def flood_table(figures: Mapping[tuple[int, str, str], Figures]) -> Table:
    """The flood: the victim's TTFT before and during it, and the engines' output then."""
    rows: list[tuple[str, ...]] = []
    for key in _ordered(figures):
        fleet, workload, arm = key
        if workload != "flood":
            continue
        f, base = figures[key], figures.get((fleet, workload, BASELINE))
        b = base if base is not None else f
        floor = figures.get((fleet, workload, CACHE_LOST))
        rows.append((str(fleet), arm, f"{_ms(f.before_p50)} / {_ms(f.before_p90)}",
                     f"{_ms(f.p50)} / {_ms(f.p90)}", _x(ratio(f.p90, b.p90)),
                     _x(ratio(f.p90, f.before_p90)),
                     _x(ratio(f.p90, floor.p90 if floor is not None else None)),
                     f"{f.output_tok_s:,.0f}", _x(ratio(f.output_tok_s, b.output_tok_s)),
                     f"{f.computed_tok_s:,.0f}",
                     _x(ratio(f.computed_tok_s, b.computed_tok_s)),
                     "-" if f.flood_done_per_s is None else f"{f.flood_done_per_s:.1f}"))
    return Table(("engines", "arm", "victim TTFT p50 / p90 ms before", "during",
                  "p90 during over cache_aware's", "p90 during over before",
                  "p90 during over cache_lost's", "engines' output tok/s during",
                  "over cache_aware's",
                  "engines' computed tok/s during", "over cache_aware's",
                  "flood requests done/s"), rows,
                 caption="**The flood** (medians over repeats; cache_lost: the victim "
                         "alone through weighbridge on engines with the prefix cache off, "
                         "its 'during' the floor a flood that evicts its sessions leaves)")


def cached_table(runs: Iterable[ArmRun]) -> Table:
    """weighbridge's prefix index against the engines: per fleet, workload and backend, the
    cached prompt tokens it predicted at dispatch and those the engines reported, summed over
    repeats."""
    sums: dict[tuple[int, str, str], list[float]] = {}
    for run in runs:
        for backend, (predicted, reported) in run.cached.items():
            total = sums.setdefault((run.fleet, run.workload, backend), [0.0, 0.0])
            total[0] += predicted
            total[1] += reported
    rows: list[tuple[str, ...]] = [
        (str(fleet), workload, backend, f"{p:,.0f}", f"{r:,.0f}", _x(ratio(p, r)))
        for (fleet, workload, backend), (p, r) in sorted(
            sums.items(), key=lambda kv: (kv[0][0], WORKLOADS.index(kv[0][1])
                                          if kv[0][1] in WORKLOADS else 99, kv[0][2]))]
    return Table(("engines", "workload", "backend", "predicted cached tokens",
                  "reported cached tokens", "predicted over reported"), rows,
                 caption="**weighbridge's prefix index against the engines** (summed over "
                         "repeats)")


def runs_table(runs: Iterable[ArmRun]) -> Table:
    """Every arm run, in the order they ran."""
    rows: list[tuple[str, ...]] = [
        (str(r.fleet), r.workload, r.arm, str(r.repeat), str(r.ok), str(r.failed),
         _rate(r.hit_rate), _ms(r.ttft.p50), _ms(r.ttft.p90), _ms(r.ttft.p99),
         f"{r.output_tok_s:,.0f}", f"{r.computed_tok_s:,.0f}",
         f"{r.cpu_per_request_s * 1e3:.2f}",
         "-" if r.victim_before is None else
         f"{_ms(r.victim_before.p50)} / {_ms(r.victim_before.p90)}",
         "-" if r.step_lag_ms is None else f"{r.step_lag_ms:.2f}",
         ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r.holds.items()) if v) or "-")
        for r in runs]
    return Table(("engines", "workload", "arm", "repeat", "ok", "failed", "hit rate",
                  "TTFT p50 ms", "p90 ms", "p99 ms", "engines' output tok/s",
                  "computed tok/s", "CPU ms/request", "victim before p50 / p90 ms",
                  "step lag ms", "weighbridge's holds"), rows,
                 caption="**Every run** (step lag: how far the emulated engines' steps ran "
                         "behind their model, a sign of CPU starvation; holds: dispatch "
                         "attempts weighbridge's admission held, by reason)")
