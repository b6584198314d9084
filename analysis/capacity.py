"""The capacity plan: how many GPUs a daily token load needs, on average and at peak, and
whether compute or KV-cache memory binds first.

1. ``tokens_per_day = requests_per_day * avg_tokens`` (prompt + output per request);
2. ``gpu_seconds_per_day = tokens_per_day / tokens_per_second_per_gpu`` (a throughput
   sustained under real load), ``gpu_hours_per_day = gpu_seconds_per_day / 3600``,
   ``average_gpus = gpu_seconds_per_day / 86400``;
3. ``peak_gpu_hours_per_day = gpu_hours_per_day * peak_to_average`` (the capacity the peak
   rate would need all day), ``peak_gpus = average_gpus * peak_to_average``;
4. KV-cache tax: ``kv_bytes_per_sequence = 2 (K and V) * layers * kv_heads * head_dim *
   context * dtype_bytes``; ``max_concurrent_sequences = floor((gpu_memory - weights) /
   kv_bytes_per_sequence)`` per GPU (GiB = 2^30 bytes). Sustaining the GPU's token rate with
   every sequence streaming at ``sequence_tokens_per_second`` needs
   ``tokens_per_second_per_gpu / sequence_tokens_per_second`` resident sequences (Little's
   Law on tokens); when fewer fit, memory binds and the peak needs
   ``peak_gpus * needed / max_concurrent_sequences`` GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weighbridge.analysis.frame import Run, load_run
from weighbridge.analysis.stability import stability

GIB = 2**30
SECONDS_PER_DAY = 86_400
DEFAULT_SEQUENCE_TOKENS_PER_SECOND = 20.0
# Seed 000's example: a day's peak arrival rate is typically 3-5x its mean; 1 would provision
# for the mean, which no fleet serves at its peak.
DEFAULT_PEAK_TO_AVERAGE = 4.0
PEAK_WINDOWS = 20  # a run's arrivals are counted in this many windows for its peak


@dataclass(frozen=True, slots=True)
class ModelMemory:
    layers: int
    head_dim: int
    context: int
    kv_heads: int | None = None  # None: every attention head holds K and V (no GQA)
    heads: int | None = None
    dtype_bytes: float = 2.0
    gpu_memory_gb: float = 80.0
    weights_gb: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "head_dim", "context", "dtype_bytes", "gpu_memory_gb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('_', '-')}: must be positive")
        if self.kv_heads is None and self.heads is None:
            raise ValueError("kv-heads: give --kv-heads (or --heads to assume all heads)")
        if self.weights_gb < 0 or self.weights_gb >= self.gpu_memory_gb:
            raise ValueError(f"weights-gb: must be below gpu-memory-gb ({self.gpu_memory_gb})")

    @property
    def kv_heads_used(self) -> int:
        return self.kv_heads if self.kv_heads is not None else int(self.heads or 0)

    @property
    def kv_bytes_per_sequence(self) -> float:
        return (2 * self.layers * self.kv_heads_used * self.head_dim * self.context
                * self.dtype_bytes)

    @property
    def max_concurrent_sequences(self) -> int:
        free = (self.gpu_memory_gb - self.weights_gb) * GIB
        return int(free // self.kv_bytes_per_sequence)


@dataclass(frozen=True, slots=True)
class CapacityInputs:
    requests_per_day: float
    avg_tokens: float
    tokens_per_second_per_gpu: float
    peak_to_average: float = DEFAULT_PEAK_TO_AVERAGE
    # Where peak_to_average came from when no flag gave it, printed among the assumptions.
    peak_assumption: str | None = None
    sequence_tokens_per_second: float | None = None
    memory: ModelMemory | None = None
    source: str = "flags"  # or the run directory the measured figures came from
    token_mix: dict[str, float] = field(default_factory=dict)  # e.g. prompt/output means

    def __post_init__(self) -> None:
        for name in ("requests_per_day", "avg_tokens", "tokens_per_second_per_gpu",
                     "peak_to_average"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('_', '-')}: must be positive")
        if self.sequence_tokens_per_second is not None and self.sequence_tokens_per_second <= 0:
            raise ValueError("sequence-tokens-per-second: must be positive")


@dataclass(frozen=True)
class CapacityPlan:
    inputs: CapacityInputs
    tokens_per_day: float
    gpu_seconds_per_day: float
    gpu_hours_per_day: float
    average_gpus: float
    peak_gpu_hours_per_day: float
    peak_gpus_compute: float
    kv_bytes_per_sequence: float | None
    max_concurrent_sequences: int | None
    sequences_needed_per_gpu: float | None
    peak_gpus_memory: float | None
    binding_constraint: str  # "compute" or "memory"
    assumptions: list[str]

    @property
    def peak_gpus(self) -> float:
        """GPUs the peak needs under the binding constraint."""
        return max(self.peak_gpus_compute, self.peak_gpus_memory or 0.0)

    @property
    def peak_gpus_whole(self) -> int:
        return math.ceil(self.peak_gpus - 1e-9)

    def to_json(self) -> dict[str, object]:
        return {
            "tokens_per_day": self.tokens_per_day,
            "gpu_seconds_per_day": self.gpu_seconds_per_day,
            "gpu_hours_per_day": self.gpu_hours_per_day,
            "average_gpus": self.average_gpus,
            "peak_gpu_hours_per_day": self.peak_gpu_hours_per_day,
            "peak_gpus": self.peak_gpus,
            "peak_gpus_whole": self.peak_gpus_whole,
            "peak_gpus_compute": self.peak_gpus_compute,
            "peak_gpus_memory": self.peak_gpus_memory,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "sequences_needed_per_gpu": self.sequences_needed_per_gpu,
            "binding_constraint": self.binding_constraint,
            "assumptions": self.assumptions,
            "inputs": {
                "requests_per_day": self.inputs.requests_per_day,
                "avg_tokens": self.inputs.avg_tokens,
                "tokens_per_second_per_gpu": self.inputs.tokens_per_second_per_gpu,
                "peak_to_average": self.inputs.peak_to_average,
                "sequence_tokens_per_second": self.inputs.sequence_tokens_per_second,
                "source": self.inputs.source,
                "token_mix": self.inputs.token_mix,
            },
        }


def plan(inputs: CapacityInputs) -> CapacityPlan:
    tokens = inputs.requests_per_day * inputs.avg_tokens
    gpu_seconds = tokens / inputs.tokens_per_second_per_gpu
    average = gpu_seconds / SECONDS_PER_DAY
    peak_compute = average * inputs.peak_to_average
    assumptions: list[str] = []
    if inputs.peak_assumption is not None:
        assumptions.append(inputs.peak_assumption)
    kv = fit = needed = peak_memory = None
    binding = "compute"
    memory = inputs.memory
    if memory is None:
        assumptions.append("KV-cache memory not assessed (give --layers, --head-dim, "
                           "--context and --kv-heads): compute is the only constraint checked")
    else:
        if memory.kv_heads is None:
            assumptions.append(f"--kv-heads not given: assuming all {memory.heads} attention "
                               f"heads hold K and V (no grouped-query attention)")
        kv = memory.kv_bytes_per_sequence
        fit = memory.max_concurrent_sequences
        speed = inputs.sequence_tokens_per_second
        if speed is None:
            speed = DEFAULT_SEQUENCE_TOKENS_PER_SECOND
            assumptions.append(f"--sequence-tokens-per-second not given: assuming "
                               f"{speed:g} tokens/s per sequence")
        needed = inputs.tokens_per_second_per_gpu / speed
        if fit < needed:
            binding = "memory"
            peak_memory = math.inf if fit == 0 else peak_compute * needed / fit
    return CapacityPlan(
        inputs=inputs, tokens_per_day=tokens, gpu_seconds_per_day=gpu_seconds,
        gpu_hours_per_day=gpu_seconds / 3600, average_gpus=average,
        peak_gpu_hours_per_day=gpu_seconds / 3600 * inputs.peak_to_average,
        peak_gpus_compute=peak_compute, kv_bytes_per_sequence=kv,
        max_concurrent_sequences=fit, sequences_needed_per_gpu=needed,
        peak_gpus_memory=peak_memory, binding_constraint=binding, assumptions=assumptions)


def plan_lines(p: CapacityPlan) -> list[tuple[str, str]]:
    """(label, value) lines of the text form."""
    i = p.inputs
    lines = [
        ("source", i.source),
        ("tokens per day", f"{i.requests_per_day:,.0f} requests x {i.avg_tokens:,.0f} tokens "
                           f"= {p.tokens_per_day:,.0f}"),
        ("GPU-seconds per day", f"{p.tokens_per_day:,.0f} / {i.tokens_per_second_per_gpu:,.1f}"
                                f" tokens/s/GPU = {p.gpu_seconds_per_day:,.0f}"),
        ("GPU-hours per day", f"{p.gpu_hours_per_day:,.1f}"),
        ("average GPUs", f"{p.average_gpus:,.2f}"),
        ("at peak", f"x {i.peak_to_average:g}: {p.peak_gpu_hours_per_day:,.1f} GPU-hours/day, "
                    f"{p.peak_gpus_compute:,.2f} GPUs"),
    ]
    if i.token_mix:
        lines.append(("token mix", ", ".join(f"{k} {v:,.1f}" for k, v in i.token_mix.items())))
    if p.kv_bytes_per_sequence is not None:
        lines += [
            ("KV bytes per sequence", f"{p.kv_bytes_per_sequence:,.0f} "
                                      f"({p.kv_bytes_per_sequence / GIB:,.3f} GiB)"),
            ("sequences that fit per GPU", f"{p.max_concurrent_sequences:,}"),
            ("sequences needed per GPU", f"{p.sequences_needed_per_gpu:,.1f}"),
        ]
    lines += [("binding constraint", p.binding_constraint),
              ("GPUs needed at peak", f"{p.peak_gpus:,.2f} (provision {p.peak_gpus_whole})")]
    lines += [("assumption", a) for a in p.assumptions]
    return lines


@dataclass(frozen=True, slots=True)
class MeasuredLoad:
    """What a run measured, for ``--from-run``: per-GPU throughput, token mix, speeds."""

    source: str
    tokens_per_second_per_gpu: float
    avg_tokens: float
    avg_prompt_tokens: float
    avg_output_tokens: float
    requests_per_day: float  # the run's arrival rate, sustained for a day
    sequence_tokens_per_second: float | None  # median decode speed of a sequence
    peak_to_average: float  # the busiest window's arrival rate over the run's mean
    peak_window_s: float  # the windows' length: the run's duration / PEAK_WINDOWS


def measured_load(run: Run, gpus: int = 1) -> MeasuredLoad:
    """``gpus``: how many GPUs (engines) served the run; its served token rate is divided
    among them."""
    if gpus <= 0:
        raise ValueError("run-gpus: must be positive")
    frame = run.frame
    ok = frame[frame["status"] == "ok"]
    if ok.empty or run.duration_s <= 0:
        raise ValueError(f"{run.path}: no completed requests to measure")
    served = stability(frame, run.duration_s).served_tokens_per_s or 0.0
    tps = ok["decode_tps"].dropna()
    window = run.duration_s / PEAK_WINDOWS
    return MeasuredLoad(
        source=str(run.path),
        tokens_per_second_per_gpu=served / gpus,
        avg_tokens=float(ok["tokens"].mean()),
        avg_prompt_tokens=float(ok["prompt_tokens"].mean()),
        avg_output_tokens=float(ok["output_tokens"].mean()),
        requests_per_day=len(frame) / run.duration_s * SECONDS_PER_DAY,
        sequence_tokens_per_second=float(tps.median()) if len(tps) else None,
        peak_to_average=peak_to_average(frame["scheduled_s"].to_numpy(), run.duration_s),
        peak_window_s=window,
    )


def peak_to_average(arrivals_s: Sequence[float] | Any, duration_s: float,
                    windows: int = PEAK_WINDOWS) -> float:
    """The busiest of ``windows`` equal windows of ``[0, duration_s)``: its arrivals over the
    mean per window (1 for a perfectly even load, ``windows`` when all arrive in one)."""
    if duration_s <= 0 or windows <= 0:
        raise ValueError("peak-to-average: needs a positive duration and window count")
    counts = [0] * windows
    for at in arrivals_s:
        if 0 <= at < duration_s:
            counts[min(windows - 1, int(at / duration_s * windows))] += 1
    total = sum(counts)
    return max(counts) * windows / total if total else 1.0


def capacity_inputs(*, requests_per_day: float | None, avg_tokens: float | None,
                    tokens_per_second_per_gpu: float | None, peak_to_average: float | None,
                    sequence_tokens_per_second: float | None, layers: int | None,
                    kv_heads: int | None, heads: int | None, head_dim: int | None,
                    context: int | None, dtype_bytes: float, gpu_memory_gb: float,
                    weights_gb: float, from_run: Path | None, run_gpus: int = 1
                    ) -> CapacityInputs:
    """The planner's inputs from the command line's flags; a flag given always wins over
    what ``from_run`` measured. Without ``peak_to_average`` the plan takes the run's own
    (with ``from_run``) or ``DEFAULT_PEAK_TO_AVERAGE``, and says so among its assumptions."""
    source, mix = "flags", {}
    peak_assumption = None
    if peak_to_average is None and from_run is None:
        peak_to_average = DEFAULT_PEAK_TO_AVERAGE
        peak_assumption = (f"--peak-to-average not given: assuming {peak_to_average:g} (a "
                           "day's peak arrival rate is typically 3-5x its mean; --from-run "
                           "measures a run's own)")
    if from_run is not None:
        m = measured_load(load_run(from_run), run_gpus)
        source = f"run {from_run} (served by {run_gpus} GPU{'s' if run_gpus > 1 else ''})"
        mix = {"prompt tokens": m.avg_prompt_tokens, "output tokens": m.avg_output_tokens}
        requests_per_day = requests_per_day or m.requests_per_day
        avg_tokens = avg_tokens or m.avg_tokens
        tokens_per_second_per_gpu = tokens_per_second_per_gpu or m.tokens_per_second_per_gpu
        sequence_tokens_per_second = sequence_tokens_per_second or m.sequence_tokens_per_second
        if peak_to_average is None:
            peak_to_average = m.peak_to_average
            peak_assumption = (f"--peak-to-average not given: the run's own, "
                               f"{peak_to_average:.2f} (its busiest {m.peak_window_s:g} s of "
                               f"arrivals over its mean); a day's peak over its mean is "
                               "typically 3-5x, which a short run may not show")
    missing = [flag for flag, value in (("--requests-per-day", requests_per_day),
                                         ("--avg-tokens", avg_tokens),
                                         ("--tokens-per-second-per-gpu",
                                          tokens_per_second_per_gpu)) if value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (or measure them with --from-run)")
    memory = None
    if any(v is not None for v in (layers, head_dim, context, kv_heads, heads)):
        absent = [flag for flag, value in (("--layers", layers), ("--head-dim", head_dim),
                                            ("--context", context)) if value is None]
        if absent:
            raise ValueError(f"{', '.join(absent)}: needed for the KV-cache estimate")
        memory = ModelMemory(layers=layers or 0, head_dim=head_dim or 0, context=context or 0,
                             kv_heads=kv_heads, heads=heads, dtype_bytes=dtype_bytes,
                             gpu_memory_gb=gpu_memory_gb, weights_gb=weights_gb)
    assert requests_per_day and avg_tokens and tokens_per_second_per_gpu and peak_to_average
    return CapacityInputs(
        requests_per_day=requests_per_day, avg_tokens=avg_tokens,
        tokens_per_second_per_gpu=tokens_per_second_per_gpu, peak_to_average=peak_to_average,
        peak_assumption=peak_assumption,
        sequence_tokens_per_second=sequence_tokens_per_second, memory=memory, source=source,
        token_mix=mix)
