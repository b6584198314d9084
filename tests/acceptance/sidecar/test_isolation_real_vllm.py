"""Issue 14's acceptance on real vLLM CPU: a config nobody tuned protects the victim on a
KV-tight engine under vLLM's default fcfs scheduling.

Engine: 32 sequences, step budget 1,024, blocks of 32 tokens, KV for 26 of the flood's
512 + 192-token sequences, ``--scheduling-policy fcfs``. The flood (500 requests at once)
and the victim (Poisson 4/s of 64 + 16 tokens) are in the same tier with the same weight;
the sidecar's config names tiers, tenants and backends only (benchmarks/isolation.py).

Judged against the ideal measured in the same run, on the same engine: the flood limiting
itself to the streams that fit in KV with room for the victim (24), straight to the engine.
The engine runs on one core and everything else (sidecar, clients, this process) on another, in
every arm alike (``cpus="split"``): the engine's compute is the same in the ideal and sidecar
arms, as on a GPU host, where the engine computes on the GPU and the sidecar does not take
from it. With both cores shared, the sidecar's 0.14 cores and its wake-ups interrupt the
engine's step loop, and the engine's output in the sidecar arm fell to 0.76-0.88 of the
ideal's while it ran as many sequences (benchmarks/RESULTS.md, isolation).
Medians of 3 interleaved repeats (ideal and sidecar alternating, a fresh sidecar each time);
p99 is printed beside them, not asserted (on a 2-core machine shared by engine, API server,
sidecar and clients it swings several-fold between repeats). The victim's client runs in a
process of its own, apart from the one consuming the flood.

The margin is the noise measured in the same run. Both arms see the same engine and
machine, interleaved, so load slows both alike and the ratio is what the sidecar adds; but
load also comes and goes between repeats, and the ideal arm, which contains no sidecar at
all, shows by how much: its own largest over smallest figure across repeats. The sidecar's
ratio may exceed the target by that factor, no more. On a quiet machine the spread is ~1.1-
1.3; in a CI run at load 6 (2026-12-01) the ideal's own p50 ranged from 212 ms to 3.1 s
(14.7x), the sidecar's ratio was 1.96x, and a fixed bound of 1.5x failed on the machine,
not the sidecar. Without protection (the issue's measurements on this engine) the victim's
p50 is 60-70x the ideal's with the same plain config.
"""

from __future__ import annotations

import pytest

from benchmarks.isolation import ArmResult, run_all, verdict

pytestmark = [pytest.mark.vllm, pytest.mark.quiet, pytest.mark.timeout(1500)]

REPEATS = 3
WARMUP_S = 4.0  # the flood is established (KV full of it) before the victim starts
WINDOW_S = 12.0  # ~48 victim requests per arm: a p90 from 4-5 samples above it


def spread(results: list[ArmResult], figure: str) -> float:
    """The ideal arm's largest over smallest ``figure`` across repeats (>= 1)."""
    values = [r.output_tokens_per_s if figure == "tok_s" else r.p(float(figure[1:]))
              for r in results if r.arm == "ideal"]
    return max(values) / min(values)


def test_plain_config_protects_the_victim_on_a_kv_tight_fcfs_engine() -> None:
    results = run_all("real", REPEATS, WARMUP_S, WINDOW_S, cpus="split")
    v = verdict(results)
    print(f"\nisolation on real vLLM, medians of {REPEATS}: victim TTFT ideal p50/p90/p99 "
          f"{v.ideal['p50'] * 1e3:.0f}/{v.ideal['p90'] * 1e3:.0f}/{v.ideal['p99'] * 1e3:.0f} "
          f"ms, sidecar {v.sidecar['p50'] * 1e3:.0f}/{v.sidecar['p90'] * 1e3:.0f}/"
          f"{v.sidecar['p99'] * 1e3:.0f} ms (p50 {v.p50_ratio:.2f}x, p90 {v.p90_ratio:.2f}x); "
          f"engine output {v.sidecar['tok_s']:.0f} against {v.ideal['tok_s']:.0f} tok/s "
          f"({v.output_ratio:.2f}); quiet p99 {v.quiet['p99'] * 1e3:.0f} ms; the ideal's own "
          f"spread over repeats p50 {spread(results, 'p50'):.2f}x, p90 "
          f"{spread(results, 'p90'):.2f}x, output {spread(results, 'tok_s'):.2f}x")
    sidecar_arms = [r for r in results if r.arm == "sidecar"]
    # Every window measured a flooded engine: the flood was still backlogged at its end.
    assert all(r.flood_left > 0 for r in sidecar_arms), [r.flood_left for r in sidecar_arms]
    assert all(r.failed == 0 for r in results), [(r.arm, r.failed) for r in results]
    # Issue 14's targets, scaled by the run's own noise (above). Measured with split CPUs on a
    # quiet machine (2026-12-01): p50 1.19x / 1.08x, p90 0.77x / 0.68x, output 0.91 / 0.99.
    assert v.p50_ratio <= 1.3 * spread(results, "p50")
    assert v.p90_ratio <= 1.3 * spread(results, "p90")
    assert v.output_ratio >= 0.85 / spread(results, "tok_s")
