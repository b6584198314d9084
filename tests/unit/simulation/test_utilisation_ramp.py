"""Issue 41, point 3: the utilisation alert fires before the backlog grows.

A load ramp from half to 1.2 times an engine's capacity, on the emulator's step model in
virtual time (weighbridge.app.simulation drives the sidecar's own core and stability meter).
The sidecar's pool rho is read as Prometheus scrapes it, every 15 s, and
WeighbridgeUtilisationHigh (deploy/prometheus/rules/sidecar.yml) is evaluated on it as
Prometheus does: the rule's own expression, threshold, averaging window and hold, read from
the file. The backlog grows from the last moment the sidecar's queue was empty: after it,
the queue never drains again (the engine's waiting queue is held to a few requests by
admission, so the backlog is the sidecar's).

The engine has KV cache to spare, so its step budget binds: the regime the seed's
condition λ(m_p + m_d) < B / t_step describes (docs/sidecar.md, "Stability and
utilisation", for the slot- or KV-bound engine rho does not see).
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path

import pytest
import yaml

from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation, UtilisationSample
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.profiles import get_profile
from weighbridge.loadgen.arrivals import Poisson
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.config import parse_config

RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "rules" / "sidecar.yml"
ENGINE, PROFILE = "engine-0", "h100-llama3-8b"
BUDGET = 2048  # vLLM's default --max-num-batched-tokens, the emulator's and the sidecar's
PROMPT, OUTPUT = 2000, 8  # prefill-heavy: few decode steps per request keep the run cheap
# The engine's capacity: a full step of B prompt tokens, whose time the profile gives (a
# decode token costs about what a prompt token does on this profile).
CAPACITY_RPS = BUDGET / get_profile(PROFILE).step_time(BUDGET, 0, 0) / (PROMPT + OUTPUT)
RAMP = (0.5, 1.2)  # of capacity
RAMP_S = 1800.0  # 2.3 % of capacity a minute: a busy hour's climb, not a step
PHASE_S = 10.0  # the ramp as a staircase of Poisson phases this long
SCRAPE_S = 15.0  # Prometheus' scrape and evaluation interval
EVERY_S = 1.0  # how often the simulation records the sidecar's reading


def _alert() -> tuple[float, float, float]:
    """WeighbridgeUtilisationHigh's threshold, averaging window and hold, in seconds."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rule = next(r for g in groups for r in g["rules"]
                if r.get("alert") == "WeighbridgeUtilisationHigh")
    match = re.fullmatch(r"avg_over_time\(pool:weighbridge_utilisation_ratio:sum\[(\d+)m\]\)"
                         r" > ([\d.]+)", rule["expr"].strip())
    assert match, rule["expr"]  # this test evaluates exactly this form
    hold = re.fullmatch(r"(\d+)m", rule["for"])
    assert hold, rule["for"]
    return float(match[2]), 60.0 * int(match[1]), 60.0 * int(hold[1])


def _run(start: float, end: float, duration_s: float, seed: int = 0) -> list[UtilisationSample]:
    """Two tenants sharing a Poisson load from ``start`` to ``end`` times the capacity."""
    n = int(duration_s / PHASE_S)
    phases = tuple(PhaseSpan(f"p{i}", i * PHASE_S, (i + 1) * PHASE_S) for i in range(n))
    lengths = Lengths.model_validate({"classes": [{"prompt": PROMPT, "output": OUTPUT}]})

    def rate(i: int) -> float:
        return CAPACITY_RPS * (start + (end - start) * (i + 0.5) / n) / 2

    tenants = tuple(TenantSpec(name=name, api_key=f"key-{name}", lengths=lengths,
                               phases={f"p{i}": Poisson(rate=rate(i)) for i in range(n)})
                    for name in ("a", "b"))
    config = parse_config({
        "tenants": {name: {"tier": "standard", "api_keys": [f"plain:key-{name}"]}
                    for name in ("a", "b")},
        "backends": [{"name": ENGINE, "url": "http://127.0.0.1:9"}]})
    # KV cache for 262k tokens: never the binding limit at ~40 requests in flight.
    engine = SimEngine(ENGINE, EmulatorOptions(profile=PROFILE, max_num_seqs=256,
                                               num_kv_blocks=16384, seed=seed))
    workload = Workload(scenario="utilisation-ramp", phases=phases, tenants=tenants)
    result = Simulation(config, [engine], WorkloadClients(workload, seed=seed,
                                                          until_s=duration_s),
                        run_id="ramp", scenario="utilisation-ramp", until_s=duration_s,
                        utilisation_every_s=EVERY_S).run()
    return result.utilisation


def _fires_at(samples: list[UtilisationSample]) -> float | None:
    """When WeighbridgeUtilisationHigh first fires, evaluated as Prometheus does: the gauge
    as each scrape finds it, averaged over the window, true at every evaluation of the hold."""
    threshold, window_s, hold_s = _alert()
    times = [s.at_s for s in samples]
    scraped: list[tuple[float, float]] = []
    pending: float | None = None
    t = SCRAPE_S
    while t <= times[-1]:
        i = bisect.bisect_right(times, t) - 1
        if (value := samples[i].pools.get(ENGINE)) is not None:
            scraped.append((t, value))
        recent = [v for at, v in scraped if at > t - window_s]
        if recent and sum(recent) / len(recent) > threshold:
            pending = t if pending is None else pending
            if t - pending >= hold_s:
                return t
        else:
            pending = None
        t += SCRAPE_S
    return None


def _load_at(t: float) -> float:
    """The ramp's offered load at ``t``, as a fraction of capacity."""
    return RAMP[0] + (RAMP[1] - RAMP[0]) * t / RAMP_S


@pytest.fixture(scope="module")
def ramp() -> list[UtilisationSample]:
    return _run(*RAMP, RAMP_S)


def test_rho_follows_the_load(ramp: list[UtilisationSample]) -> None:
    """Below saturation rho reads the offered share of capacity: within 0.1 of the ramp's
    load averaged over each tenth of the climb below 0.9 (arrivals over the sidecar's 10 s
    window vary ~7 %, and the capacity above is the profile's, not the fit's)."""
    for k in range(10):
        lo, hi = k * RAMP_S / 10, (k + 1) * RAMP_S / 10
        if _load_at(hi) > 0.9:
            break
        values = [s.pools[ENGINE] for s in ramp if lo <= s.at_s < hi and ENGINE in s.pools]
        assert values
        assert sum(values) / len(values) == pytest.approx(_load_at((lo + hi) / 2), abs=0.1)


def test_the_alert_fires_before_the_backlog_grows(ramp: list[UtilisationSample]) -> None:
    empty = [s.at_s for s in ramp if s.queued_requests == 0]
    onset = max(empty)
    assert onset < RAMP_S - 60  # the ramp ends in overload: the queue grows from there
    fired = _fires_at(ramp)
    print(f"\n[utilisation ramp] capacity {CAPACITY_RPS:.2f} req/s; the alert fires at "
          f"{fired} s (load {_load_at(fired or 0):.2f}), the queue last empty at {onset:.0f} s "
          f"(load {_load_at(onset):.2f})")
    assert fired is not None
    assert fired < onset
    assert _load_at(fired) < 1.0  # before the offered load passes capacity, too


def test_the_alert_stays_quiet_at_a_steady_four_fifths_of_capacity() -> None:
    """Fifteen minutes at 80 % of capacity, well served: rho hovers near 0.8 and the alert
    never fires (its threshold, averaged over a minute, is 0.1 above)."""
    steady = _run(0.8, 0.8, 900.0, seed=1)
    assert max(s.queued_requests for s in steady) < 20  # served: no backlog to warn of
    assert _fires_at(steady) is None
