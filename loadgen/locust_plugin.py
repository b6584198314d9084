"""Locust glue: options, the run's lifecycle, and the one User and one LoadTestShape.

``scenarios/locustfile.py`` calls :func:`install`, which registers weighbridge's options and
event listeners and returns the only User and LoadTestShape classes in the folder, so Locust
never has to pick among several shapes. Traffic does not come from Locust users: one idle
placeholder user per process keeps Locust's run going, and the process's
:class:`~loadgen.driver.TrafficDriver` sends the scenario's requests on their schedule.

The run's lifecycle across processes:

* the master (or a local runner), at ``test_start``: resolves the scenario, picks the run
  id and the run's t = 0 (a wall-clock time slightly in the future), writes ``run.json``
  and puts the run's identity into its parsed options, which Locust sends to every worker
  with the spawn message;
* every process that sends (a local runner or a worker), at ``test_start``: converts t = 0
  to its monotonic clock, starts its share of the schedule, appends to its own
  ``records-<process>.jsonl``; at ``test_stop``: cancels what is in flight and writes
  ``generator-<process>.json`` (its counts), which tells the master it is done;
* the master (or local runner), once every sending process is done: merges the records into
  ``requests.parquet`` and completes ``run.json`` (duration, phases, schedule-lag summary).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import orjson
import pyarrow.compute as pc
import pyarrow.parquet as pq
from locust import LoadTestShape, User, constant, events, task
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner, WorkerRunner

from weighbridge.loadgen.bodies import prompt_text
from weighbridge.loadgen.client import HttpTarget
from weighbridge.loadgen.driver import TrafficDriver
from weighbridge.loadgen.lag import LagSummary, lag_warning
from weighbridge.loadgen.plan import RequestPlan
from weighbridge.loadgen.scenario import (
    PhaseSpan,
    Scenario,
    ScenarioError,
    Workload,
    discover_scenarios,
)
from weighbridge.loadgen.tenants import TenantsError
from weighbridge.loadgen.trace import (
    TenantRule,
    TraceError,
    TraceReplay,
    TraceRows,
    read_trace_rows,
    trace_replay,
)
from weighbridge.records import RecordAppender, RequestRecord
from weighbridge.rundir import (
    REQUESTS_PARQUET,
    RUN_JSON,
    RunInfo,
    finish_run,
    read_run_info,
    records_path,
    write_run_info,
)

__all__ = ["DEFAULT_EXPORTER_PORT", "DEFAULT_SCENARIO", "install"]

log = logging.getLogger("weighbridge.loadgen")

DEFAULT_SCENARIO = "noisy_neighbour"
DEFAULT_EXPORTER_PORT = 9646
_RUN_KEY = "weighbridge_run"  # the run's identity in the parsed options sent to workers
_LEAD_LOCAL_S = 0.1  # t = 0 this far after test_start: the driver is ready before it
_LEAD_DISTRIBUTED_S = 1.0  # spawn messages must reach every worker first
_DONE_TIMEOUT_S = 60.0


def _generator_path(run_dir: Path, process: str) -> Path:
    return run_dir / f"generator-{process}.json"


@dataclass
class _Options:
    """The weighbridge options, validated once (the edge)."""

    scenario: Scenario
    tenants_file: Path | None
    scale: float
    stretch: float
    seed: int
    model: str | None
    records_dir: Path | None
    run_id: str | None
    exporter_port: int | None  # None: the default (on when exporters are installed)
    exporter_host: str
    max_connections: int
    # Test-only fault: the exporter never hears the end of every Nth request, as if the
    # generator lost it (the Little's Law check must then depart from 1). 0: off.
    test_drop_every: int
    run_time_s: float | None
    trace: Path | None = None  # replay this trace with the scenario's tenants
    trace_tenants: TenantRule = field(default_factory=lambda: TenantRule("auto"))
    trace_speed: float = 1.0
    _rows: TraceRows | None = None

    def trace_rows(self) -> TraceRows | None:
        if self.trace is not None and self._rows is None:
            self._rows = read_trace_rows(self.trace)
        return self._rows

    def workload(self) -> Workload:
        workload = self.scenario.workload(tenants_file=self.tenants_file, scale=self.scale,
                                          stretch=self.stretch)
        rows = self.trace_rows()
        if rows is None:
            return workload
        # One phase: the trace's last send, then as long as its slowest tenant may wait for
        # each turn of its longest session (a replay ends sooner: when its last answer has).
        end = rows.end_s / self.trace_speed + rows.longest_session * max(
            t.timeout_s for t in workload.tenants)
        assert self.trace is not None
        return Workload(f"trace:{self.trace.stem}", (PhaseSpan("trace", 0.0, end),),
                        workload.tenants)

    def replay(self, workload: Workload, model: str | None) -> TraceReplay | None:
        """What the trace sends (None without a trace), with the run's model."""
        rows = self.trace_rows()
        if rows is None:
            return None
        return trace_replay(rows, workload.tenants, self.trace_tenants, speed=self.trace_speed,
                            seed=self.seed, model=model)


@dataclass
class _Process:
    """What this process holds for the current run."""

    scenarios: dict[str, Scenario]
    run: dict[str, Any] | None = None  # the identity the master sent
    run_dir: Path | None = None
    workload: Workload | None = None
    driver: TrafficDriver | None = None
    appender: RecordAppender | None = None
    name: str = "local"
    exporter: Any = None
    finalizer: gevent.Greenlet | None = None
    finished: set[str] = field(default_factory=set)


_STATE: _Process | None = None


def _state() -> _Process:
    if _STATE is None:
        raise RuntimeError("loadgen.locust_plugin.install() was not called")
    return _STATE


# -- options ------------------------------------------------------------------------------


def _add_arguments(parser: Any) -> None:
    names = sorted(_state().scenarios)
    # Locust's own parser (not an argument group) knows include_in_web_ui.
    group = parser
    group.add_argument("--scenario", choices=names, default=DEFAULT_SCENARIO
                       if DEFAULT_SCENARIO in names else (names[0] if names else None),
                       help=f"Scenario to run (default {DEFAULT_SCENARIO}): {', '.join(names)}")
    group.add_argument("--records-dir", default="",
                       help="Run directory for records and run.json (default runs/<run-id>)")
    group.add_argument("--run-id", default="", help="Run id (default <scenario>-<UTC time>)")
    group.add_argument("--tenants-file", default="",
                       help="Tenants YAML replacing the scenario's own")
    group.add_argument("--scale", type=float, default=1.0,
                       help="Multiply every tenant's rate, burst size and closed-loop users")
    group.add_argument("--stretch", type=float, default=1.0,
                       help="Multiply every phase's duration")
    group.add_argument("--seed", type=int, default=0, help="Seed of arrivals and sizes")
    group.add_argument("--model", default="",
                       help="Model name to send (default: the server's first /v1/models)")
    group.add_argument("--exporter-port", type=int, default=None,
                       help=f"Prometheus port of the per-tenant exporter (default "
                            f"{DEFAULT_EXPORTER_PORT}; 0 = off; worker N uses port + N)")
    group.add_argument("--exporter-host", default="127.0.0.1",
                       help="Address the exporter listens on (0.0.0.0 to be scraped from "
                            "other hosts, e.g. in docker compose)")
    group.add_argument("--test-drop-every", type=int, default=0, include_in_web_ui=False,
                       help="TEST ONLY: hide every Nth finished request from the exporter, "
                            "so its Little's Law check must fail (docs/metrics.md)")
    group.add_argument("--trace", default="",
                       help="Replay a trace (Mooncake JSONL, a run's records, CSV/Parquet) "
                            "at its times, sent by the scenario's tenants")
    group.add_argument("--trace-tenants", default="auto",
                       help="Which tenant sends each trace row: auto (column:tenant when "
                            "every row names one, else hash), hash (of the first block), "
                            "round_robin, or column:NAME")
    group.add_argument("--trace-speed", type=float, default=1.0,
                       help="Replay the trace this many times as fast")
    group.add_argument("--max-connections", type=int, default=10_000,
                       help="Connection pool size of each process", include_in_web_ui=False)


def _resolve(parsed: Any) -> _Options:
    """The options, checked: unknown scenario, bad tenants file or numbers fail here."""
    scenarios = _state().scenarios
    name = parsed.scenario
    if name not in scenarios:
        raise ScenarioError(f"--scenario: unknown scenario {name!r}; "
                            f"known: {', '.join(sorted(scenarios))}")
    try:
        scale, stretch = float(parsed.scale), float(parsed.stretch)
        seed = int(parsed.seed)
        max_connections = int(parsed.max_connections)
        port = None if parsed.exporter_port in (None, "") else int(parsed.exporter_port)
        drop_every = int(getattr(parsed, "test_drop_every", 0) or 0)
        trace_speed = float(getattr(parsed, "trace_speed", 1.0) or 1.0)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"bad number in the weighbridge options: {exc}") from None
    if max_connections < 1:
        raise ScenarioError("--max-connections must be >= 1")
    if port is not None and not 0 <= port < 65536:
        raise ScenarioError(f"--exporter-port must be 0-65535, got {port}")
    if drop_every < 0:
        raise ScenarioError("--test-drop-every must be >= 0")
    if not trace_speed > 0:
        raise ScenarioError(f"--trace-speed must be > 0, got {trace_speed}")
    trace = getattr(parsed, "trace", "") or ""
    try:
        rule = TenantRule.parse(getattr(parsed, "trace_tenants", "") or "auto")
    except TraceError as exc:
        raise ScenarioError(f"--trace-tenants: {exc}") from None
    options = _Options(
        scenario=scenarios[name],
        tenants_file=Path(parsed.tenants_file) if parsed.tenants_file else None,
        scale=scale, stretch=stretch, seed=seed, model=parsed.model or None,
        records_dir=Path(parsed.records_dir) if parsed.records_dir else None,
        run_id=parsed.run_id or None, exporter_port=port,
        exporter_host=getattr(parsed, "exporter_host", None) or "127.0.0.1",
        test_drop_every=drop_every, max_connections=max_connections,
        run_time_s=float(parsed.run_time) if getattr(parsed, "run_time", None) else None,
        trace=Path(trace) if trace else None, trace_tenants=rule, trace_speed=trace_speed,
    )
    try:
        # Loads and checks the tenants (and the trace's rows and tenants) now, not mid-run.
        options.replay(options.workload(), None)
    except (TraceError, OSError) as exc:
        raise ScenarioError(f"--trace: {exc}") from None
    return options


def _exporter_class(port: int | None) -> Any:
    """LoadgenExporter, or None when off; a clear failure when asked for and missing."""
    if port == 0:
        return None
    try:
        from weighbridge.exporters.loadgen import LoadgenExporter
    except ImportError as exc:
        if port is None:  # only the default asked for it
            log.warning("per-tenant exporter off: exporters.loadgen is not importable (%s)",
                        exc)
            return None
        raise ScenarioError(
            f"--exporter-port {port}: the exporter (exporters/loadgen.py) cannot be "
            f"imported: {exc}; pass --exporter-port 0 to run without it") from None
    return LoadgenExporter


def _fail(environment: Environment, message: str) -> None:
    log.error("weighbridge: %s", message)
    sys.stderr.write(f"weighbridge: {message}\n")
    if environment.runner is not None:
        environment.runner.quit()
    sys.exit(2)


# -- run identity (master or local) -------------------------------------------------------


def _git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False, cwd=Path(__file__).parent)
        if out.returncode == 0:
            return out.stdout.strip() or None
    return None


def _detect_model(host: str, options: _Options, workload: Workload) -> str | None:
    """The run's model, for the tenants that name none of their own: ``--model``, else the
    first the target lists (None when every tenant names its own)."""
    if options.model:
        return options.model
    if all(t.model for t in workload.tenants):
        return None
    key = next((t.api_key for t in workload.tenants if t.api_key), None)
    target = HttpTarget(host, max_connections=1, connect_timeout_s=5, read_timeout_s=10)
    try:
        models = target.get_json("/v1/models",
                                 {"authorization": f"Bearer {key}"} if key else None)
        # Why the ignore below: untyped JSON; a malformed answer raises and is handled below.
        return str(models["data"][0]["id"])  # type: ignore[index]
    except Exception as exc:
        log.warning("could not read the model name from %s/v1/models (%s); sending none",
                    host, exc)
        return None
    finally:
        target.close()


def _detect_chat_overhead(host: str, workload: Workload, model: str | None) -> int | None:
    """The chat template's framing in prompt tokens, from one small request, so that chat
    prompts are the drawn size from the first request on (None: learn it from the run)."""
    tenant = next((t for t in workload.tenants if t.endpoint == "chat"), None)
    if tenant is None:
        return None
    words = 16
    model = tenant.model or model
    body = {"messages": [{"role": "user", "content": prompt_text(words, 0)}],
            "max_tokens": 1, "stream": False, **({"model": model} if model else {})}
    headers = {"authorization": f"Bearer {tenant.api_key}"} if tenant.api_key else {}
    target = HttpTarget(host, max_connections=1, connect_timeout_s=5, read_timeout_s=30)
    try:
        response = target.client.post(tenant.path, body=orjson.dumps(body), headers=headers)
        answer = orjson.loads(response.read())
        return int(answer["usage"]["prompt_tokens"]) - words
    except Exception as exc:
        log.warning("could not measure the chat template's framing (%s); learning it from "
                    "the first responses", exc)
        return None
    finally:
        target.close()


def _begin_run(environment: Environment) -> None:
    state = _state()
    parsed = environment.parsed_options
    options = _resolve(parsed)
    workload = options.workload()
    now = dt.datetime.now(dt.UTC)
    run_id = options.run_id or f"{options.scenario.name}-{now:%Y%m%d-%H%M%S}"
    run_dir = options.records_dir or Path("runs") / run_id
    if (run_dir / RUN_JSON).exists() or any(run_dir.glob("records-*.jsonl")):
        raise ScenarioError(f"{run_dir} already holds a run; give an empty --records-dir")
    host = environment.host or ""
    if not host:
        raise ScenarioError("no target: pass --host URL (the sidecar, emulator or vLLM)")
    distributed = isinstance(environment.runner, MasterRunner)
    # Why the ignore below: distributed means the runner is a MasterRunner (checked above).
    workers = environment.runner.worker_count if distributed else 1  # type: ignore[union-attr]
    model = _detect_model(host, options, workload)
    chat_overhead = _detect_chat_overhead(host, workload, model)
    t0_wall = time.time() + (_LEAD_DISTRIBUTED_S if distributed else _LEAD_LOCAL_S)
    limit = workload.end_s if options.run_time_s is None else min(
        workload.end_s, options.run_time_s - (t0_wall - time.time()))
    info = RunInfo(
        run_id=run_id, scenario=workload.scenario,
        started_at=dt.datetime.fromtimestamp(t0_wall, dt.UTC), target=host,
        git_commit=_git_commit(), tenants=workload.tenant_infos(),
        phases=workload.phase_infos(limit),
        options={"scenario": options.scenario.name, "tenants_file":
                 str(options.tenants_file or options.scenario.tenants_file),
                 "scale": options.scale, "stretch": options.stretch, "seed": options.seed,
                 "model": model, "run_time_s": options.run_time_s,
                 "processes": workers, "host": host,
                 **({"victim": workload.victim} if workload.victim else {}),
                 **({"trace": str(options.trace), "trace_tenants": str(options.trace_tenants),
                     "trace_speed": options.trace_speed} if options.trace else {})},
    )
    write_run_info(run_dir, info)
    state.run = {"run_id": run_id, "dir": str(run_dir.resolve()), "t0_wall": t0_wall,
                 "processes": workers, "model": model, "until_s": limit,
                 "chat_overhead": chat_overhead}
    state.run_dir = run_dir
    state.workload = workload
    state.finished = set()
    state.finalizer = None
    # Locust sends custom parsed options to every worker with the spawn message.
    setattr(parsed, _RUN_KEY, state.run)
    log.info("weighbridge run %s: scenario %s, %d tenant(s), records in %s", run_id,
             options.scenario.name, len(workload.tenants), run_dir)


# -- sending (local or worker) ------------------------------------------------------------


def _fire_stats(environment: Environment, record: RequestRecord) -> None:
    """Per-tenant rows in Locust's statistics: E2E for every request, TTFT when a first
    token came. Locust rounds; the records keep exact values. Requests cut off because the
    run ended are left out: they did not end, the run did."""
    if record.status == "cancelled":
        return
    ok = record.status == "ok"
    failure = None if ok else RuntimeError(f"{record.status}: {record.reason or '-'}")
    environment.events.request.fire(
        request_type="E2E", name=record.tenant, response_time=record.e2e_s * 1000,
        response_length=record.output_tokens or 0, exception=failure, context={})
    if record.ttft_s is not None:
        environment.events.request.fire(
            request_type="TTFT", name=record.tenant, response_time=record.ttft_s * 1000,
            response_length=record.prompt_tokens or 0, exception=None, context={})


def _start_sending(environment: Environment) -> None:
    state = _state()
    run = getattr(environment.parsed_options, _RUN_KEY, None) or state.run
    if run is None:
        raise ScenarioError("no run identity from the master")
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        index, count = runner.worker_index, int(run["processes"])
        state.name = f"worker-{index}"
        if not 0 <= index < count:
            raise ScenarioError(f"worker index {index} but the run has {count} worker(s); "
                                "start workers before the run")
    else:
        index, count = 0, 1
        state.name = "local"
    options = _resolve(environment.parsed_options)
    # A local runner resolved the workload at the start of this run; a worker resolves the
    # options the master sent for this run (the web UI may have changed them since).
    workload = state.workload if isinstance(runner, LocalRunner) and state.workload else \
        options.workload()
    state.workload = workload
    run_dir = Path(run["dir"])
    state.run_dir = run_dir
    state.run = run
    # The run's t = 0 on this process's monotonic clock (all processes share wall time).
    t0 = time.monotonic() + (float(run["t0_wall"]) - time.time())
    appender = RecordAppender(records_path(run_dir, state.name))
    state.appender = appender

    exporter = _start_exporter(options, workload, index, isinstance(runner, WorkerRunner))

    ended = 0

    def on_record(record: RequestRecord) -> None:
        nonlocal ended
        appender.append(record)
        _fire_stats(environment, record)
        ended += 1
        if exporter is not None and not (
                options.test_drop_every and ended % options.test_drop_every == 0):
            exporter.request_ended(record, t0 + record.end_s)

    def on_start(plan: RequestPlan) -> None:
        # The exporter's clock is time.monotonic; a request "starts" at its scheduled time,
        # as its record's latencies do.
        exporter.request_started(plan.tenant, plan.tier, plan.prompt_tokens + plan.max_tokens,
                                 t0 + plan.scheduled_s)
        program = plan.program
        if program is not None and program.parent_id is None and plan.turn == 0:
            exporter.program_started(plan.tenant, plan.tier, program.program_id,
                                     t0 + plan.scheduled_s)

    target = HttpTarget(environment.host or "", max_connections=options.max_connections)
    state.driver = TrafficDriver(
        workload, target, run_id=str(run["run_id"]), t0=t0, seed=options.seed,
        model=run.get("model"), index=index, count=count,
        until_s=float(run["until_s"]), chat_overhead=run.get("chat_overhead"),
        trace=options.replay(workload, run.get("model")), on_record=on_record,
        on_start=on_start if exporter is not None else None,
        on_lag=exporter.schedule_lag if exporter is not None else None,
    )
    state.driver.start()


def _start_exporter(options: _Options, workload: Workload, index: int, worker: bool) -> Any:
    state = _state()
    if state.exporter is not None:
        return state.exporter
    cls = _exporter_class(options.exporter_port)
    if cls is None:
        return None
    port = (options.exporter_port or DEFAULT_EXPORTER_PORT) + (index if worker else 0)
    exporter = cls(weights={t.name: t.weight for t in workload.tenants},
                   tiers={t.name: t.tier for t in workload.tenants})
    exporter.serve(port, options.exporter_host)
    log.info("per-tenant metrics on %s:%d/metrics", options.exporter_host, port)
    state.exporter = exporter
    return exporter


def _stop_sending() -> None:
    state = _state()
    driver, appender = state.driver, state.appender
    if driver is None or appender is None or state.run_dir is None:
        return
    driver.stop()
    driver.target.close()
    appender.close()
    summary = LagSummary.of(driver.stats.lags)
    done = {"process": state.name, "records": sum(driver.stats.statuses.values()),
            "schedule_lag": summary.to_dict(), **driver.stats.to_dict()}
    path = _generator_path(state.run_dir, state.name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(done, indent=2) + "\n")
    tmp.replace(path)  # the master treats the file's existence as "done"
    state.driver = state.appender = None


# -- finishing (master or local) ----------------------------------------------------------


def _finish_run(expected: list[str], timeout_s: float = _DONE_TIMEOUT_S) -> None:
    """Once every sending process has reported, merge the records and complete run.json."""
    state = _state()
    run_dir, run = state.run_dir, state.run
    if run_dir is None or run is None or (run_dir / REQUESTS_PARQUET).exists():
        return
    deadline = time.monotonic() + timeout_s
    missing = expected
    while missing := [p for p in expected if not _generator_path(run_dir, p).exists()]:
        if time.monotonic() > deadline:
            log.error("processes %s did not report; merging what they wrote", missing)
            break
        gevent.sleep(0.2)
    duration = max(0.0, time.time() - float(run["t0_wall"]))
    count = finish_run(run_dir)
    table = pq.read_table(run_dir / REQUESTS_PARQUET, columns=["sent_s", "scheduled_s"])
    lags = pc.subtract(table["sent_s"], table["scheduled_s"]).drop_null().to_pylist()
    summary = LagSummary.of(lags)
    warning = lag_warning(summary)
    processes = {}
    for path in sorted(run_dir.glob("generator-*.json")):
        processes[path.stem.removeprefix("generator-")] = json.loads(path.read_text())
    info = read_run_info(run_dir)
    until = float(run["until_s"])
    info = info.model_copy(update={
        "duration_s": duration,
        "phases": state.workload.phase_infos(min(until, duration))
        if state.workload else info.phases,
        "generator": {"requests": count, "schedule_lag": summary.to_dict(),
                      "lag_warning": warning, "missing_processes": missing,
                      "processes": processes},
    })
    write_run_info(run_dir, info)
    if warning:
        log.warning("weighbridge: %s", warning)
        sys.stderr.write(f"WARNING weighbridge: {warning}\n")
    p99 = summary.p99_s * 1000 if not math.isnan(summary.p99_s) else float("nan")
    log.info("weighbridge run %s: %d records in %s (schedule lag p99 %.2f ms)",
             run["run_id"], count, run_dir / REQUESTS_PARQUET, p99)


def _worker_names() -> list[str]:
    run = _state().run
    return [] if run is None else [f"worker-{i}" for i in range(int(run["processes"]))]


# -- listeners -----------------------------------------------------------------------------


def _on_init(environment: Environment, **_kw: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or environment.parsed_options is None:
        return  # a worker takes its options from the master at the start of a run
    try:
        options = _resolve(environment.parsed_options)
        _exporter_class(options.exporter_port)
    except (ScenarioError, TenantsError) as exc:
        _fail(environment, str(exc))


def _on_test_start(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    try:
        if isinstance(runner, MasterRunner | LocalRunner):
            _begin_run(environment)
        if not isinstance(runner, MasterRunner):
            _start_sending(environment)
    except (ScenarioError, TenantsError, OSError) as exc:
        _fail(environment, str(exc))


def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    if not isinstance(runner, MasterRunner):
        _stop_sending()
    if isinstance(runner, LocalRunner):
        _finish_run(["local"])
    elif isinstance(runner, MasterRunner):
        state = _state()
        if state.finalizer is None and state.run is not None:
            # Headless runs quit the master before the workers stop: wait for them aside.
            state.finalizer = gevent.spawn(_finish_run, _worker_names())


def _on_quitting(environment: Environment, **_kw: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        _stop_sending()
        return
    state = _state()
    if state.finalizer is not None:
        state.finalizer.join(timeout=_DONE_TIMEOUT_S + 5)
    elif state.run is not None:
        local = isinstance(environment.runner, LocalRunner)
        _finish_run(["local"] if local else _worker_names())


# -- the classes Locust runs ---------------------------------------------------------------


class ScenarioUser(User):
    """An idle placeholder, one per process: the run's traffic comes from the driver."""

    wait_time = constant(3600)

    @task
    def idle(self) -> None:
        gevent.sleep(3600)


class ScenarioShape(LoadTestShape):
    """One placeholder user per sending process until the scenario (or ``-t``) ends."""

    use_common_options = True  # it reads --run-time (users and spawn rate do not apply)

    def tick(self) -> tuple[int, float] | None:
        run = _STATE.run if _STATE is not None else None
        driver = _STATE.driver if _STATE is not None else None
        if driver is not None and driver.trace is not None and driver.drained():
            return None  # a replayed trace is over when its last request has ended
        if run is not None and self.get_run_time() >= float(run["until_s"]) + \
                (_LEAD_DISTRIBUTED_S if isinstance(self.runner, MasterRunner) else
                 _LEAD_LOCAL_S):
            return None
        runner = self.runner
        users = max(1, runner.worker_count) if isinstance(runner, MasterRunner) else 1
        return users, float(users)


def install(scenarios_dir: Path, exclude: tuple[Path, ...] = ()) -> tuple[type[User],
                                                                         type[LoadTestShape]]:
    """Discover the scenarios in ``scenarios_dir``, register weighbridge's options and
    listeners (once per process) and return the User and Shape classes to expose."""
    global _STATE
    if _STATE is None:
        _STATE = _Process(scenarios=discover_scenarios(scenarios_dir, exclude))
        events.init_command_line_parser.add_listener(_add_arguments)
        events.init.add_listener(_on_init)
        events.test_start.add_listener(_on_test_start)
        events.test_stop.add_listener(_on_test_stop)
        events.quitting.add_listener(_on_quitting)
    return ScenarioUser, ScenarioShape
