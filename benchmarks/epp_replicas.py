"""Two ``weighbridge epp`` replicas behind one Envoy, sharing state through Redis (issue 42's
acceptance): the acceptance tests' own measurements, repeated, as ``benchmarks.replicas``
repeats the sidecar's.

The scenarios are written once, as tests: ``tests/integration/epp/test_replicas.py``
(requests/min and tokens/min held across both pickers; one picker SIGKILLed mid-run) and
``tests/integration/epp/test_replicas_share.py`` (tenants weighted 4:1 on a saturated engine
through both). Each test prints one ``FIGURES {json}`` line; this benchmark runs each file
with pytest in a subprocess several times and reports every figure over the repeats against
the issue's targets: limits within 2%, the 4:1 share within 5%, and after the kill every
request ended once, the survivor's ledger balanced and every request after the ejection
served.

``python -m benchmarks epp_replicas`` (records into RESULTS.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.replicas import FileRun, run_file

LIMITS_FILE = "tests/integration/epp/test_replicas.py"
SHARE_FILE = "tests/integration/epp/test_replicas_share.py"
RUNS, SHARE_RUNS = 2, 3
LIMIT_ERROR_PCT, SHARE_ERROR_PCT = 2.0, 5.0


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "n/a"
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values),
                                               max(values)))
    return f"{low} / {mid} / {high}"


def _figures(runs: list[FileRun], test: str) -> list[dict[str, Any]]:
    return [r.figures[test] for r in runs if test in r.figures]


def _killed_ok(f: dict[str, Any]) -> bool:
    ends = f["ends"]
    return (sum(ends.values()) == 120 and all(lg["unbalanced"] == 0
                                              for lg in f["survivor_ledger"])
            and f["after_ejection"] == {"200": 20})


ROWS: tuple[tuple[str, str, str, Callable[[dict[str, Any]], float], str,
                  Callable[[dict[str, Any]], bool] | None], ...] = (
    ("requests_per_minute", "requests/min across 2 pickers: error %", "within ±2%",
     lambda f: f["error_pct"], "{:+.2f}", lambda f: abs(f["error_pct"]) <= LIMIT_ERROR_PCT),
    ("tokens_per_minute", "tokens/min across 2 pickers: error %", "within ±2%",
     lambda f: f["error_pct"], "{:+.2f}", lambda f: abs(f["error_pct"]) <= LIMIT_ERROR_PCT),
    ("share", "weighted share heavy:light (weights 4:1)", "4.0 within 5%",
     lambda f: f["ratio"], "{:.2f}", lambda f: abs(f["error_pct"]) <= SHARE_ERROR_PCT),
    ("share", "share: error %", "", lambda f: f["error_pct"], "{:+.1f}", None),
    ("picker_killed", "kill: requests ended (of 120)", "120, once each",
     lambda f: sum(f["ends"].values()), "{:.0f}", _killed_ok),
    ("picker_killed", "kill: streams cut or 500 at the client", "",
     lambda f: sum(v for k, v in f["ends"].items() if k != "200"), "{:.0f}", None),
    ("picker_killed", "kill: survivor's ledger imbalance", "0",
     lambda f: sum(abs(lg["unbalanced"]) for lg in f["survivor_ledger"]), "{:.0f}",
     lambda f: all(lg["unbalanced"] == 0 for lg in f["survivor_ledger"])),
    ("picker_killed", "kill: served after the ejection (of 20)", "20",
     lambda f: f["after_ejection"].get("200", 0), "{:.0f}",
     lambda f: f["after_ejection"] == {"200": 20}),
)


def bench_result(runs: list[FileRun]) -> BenchResult:
    rows, met_all = [], True
    for test, label, target, value, fmt, meets in ROWS:
        seen = _figures(runs, test)
        if meets is None:
            verdict = "context"
        else:
            ok = sum(1 for f in seen if meets(f))
            verdict = f"{ok}/{len(seen)}"
            met_all = met_all and bool(seen) and ok == len(seen)
        rows.append((label, target or "-", _spread([float(value(f)) for f in seen], fmt),
                     verdict))
    figures = Table(("figure", "target (issue 42)", "min / median / max", "runs meeting it"),
                    rows)
    per_run = Table(("file", "run", "test", "figures"),
                    [(r.file.rpartition("/")[2], str(r.index + 1), test, str(f))
                     for r in runs for test, f in r.figures.items()])
    shares = [f["ratio"] for f in _figures(runs, "share")]
    errors = [f["error_pct"] for test in ("requests_per_minute", "tokens_per_minute")
              for f in _figures(runs, test)]
    summary = [
        f"Global limits across two pickers behind one Envoy: {_spread(errors, '{:+.2f}')}% "
        f"of the configured (target within ±{LIMIT_ERROR_PCT:.0f}%).",
        f"Weighted share 4:1 across both: {_spread(shares, '{:.2f}')}:1 (target within "
        f"{SHARE_ERROR_PCT:.0f}%).",
        f"Every judged figure met in every run: **{'yes' if met_all else 'no'}**.",
    ]
    failures = [f"{r.file} run {r.index + 1}: {test}: {outcome} {message[:300]}"
                for r in runs for test, (outcome, message) in r.outcomes.items()
                if outcome != "passed"]
    notes = [
        "The acceptance tests' own measurements, repeated (`python -m pytest -q -s FILE`, a "
        "subprocess per run): each test prints one FIGURES line, collected here.",
        "Limits: 60 requests/s for 5 s through Envoy, which sends each request's stream to "
        "either picker (round robin); allowed = the bucket's capacity plus its refill over "
        "the run, once for both pickers. tokens/min: each request costs exactly 20 tokens.",
        "Share: 24 closed-loop clients of each tenant (weights 4 and 1) through Envoy on one "
        "engine of 8 sequences, output tokens answered in a 16 s window after 4 s of "
        "warm-up. The admission rules that judge a tenant's share of in-flight slots decide "
        "more than DRR's order here (tests/integration/epp/test_replicas_share.py).",
        "Kill: 20 streams/s for 6 s; one picker SIGKILLed after 2 s; Envoy health-checks the "
        "pickers every second and ejects one that refuses a stream.",
        *failures,
    ]
    return BenchResult(summary, [figures, per_run], notes=notes, passed=met_all)


def run(ctx: BenchContext) -> BenchResult:
    runs, share_runs = (1, 1) if ctx.quick else (RUNS, SHARE_RUNS)
    results = [run_file(LIMITS_FILE, i, ctx.log) for i in range(runs)]
    results += [run_file(SHARE_FILE, i, ctx.log) for i in range(share_runs)]
    return bench_result(results)


BENCHMARK = Benchmark("epp_replicas", "epp: two pickers behind one Envoy sharing state "
                                      "through Redis, the tests' own figures repeated", run)
