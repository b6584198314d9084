"""The ``weighbridge`` command line. Thin: it validates flags and hands off to the parts.

Each command imports its part inside the function, on purpose: the parts' dependencies are
extras (a ``weighbridge[sidecar]`` install has no pandas or Locust, so ``weighbridge
sidecar`` must not import analysis/ or loadgen/), and ``weighbridge --help`` stays quick.
They are not hidden: import-linter reads function-level imports too, and the contracts in
pyproject.toml put this module at the top of the layering (docs/architecture.md).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from weighbridge.emulator.options import EmulatorOptions
from weighbridge.extras import install_hint, missing_here
from weighbridge.settings_file import problems

if TYPE_CHECKING:
    from weighbridge.sidecar import Config

app = typer.Typer(
    name="weighbridge",
    help="Token-aware multi-tenant fair scheduling and measurement for vLLM serving.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Token-aware multi-tenant fair scheduling and measurement for vLLM serving."""


def _needs(*extras: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command that runs only with these extras installed: without one it says which, and
    the pip command, in one line and exits 2 (a usage error), instead of an import's
    traceback."""
    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        # A command's words are its function's name: dashboards_push is `dashboards push`.
        words = "weighbridge " + command.__name__.replace("_", " ")

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            if missing := missing_here(extras):
                typer.echo(install_hint(words, missing), err=True)
                raise typer.Exit(2)
            command(**kwargs)
        return run
    return decorate


def _with_emulator_options(command: Callable[..., None]) -> Callable[..., None]:
    """A command that takes every field of ``EmulatorOptions`` as an option (its description
    is the help, ``cli_flags`` the spellings), besides the command's own parameters; the
    command receives them as one ``options`` instance. One declaration, the model's, for
    the flags, the stack files and the code that starts engines."""
    model = EmulatorOptions
    own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items()
           if name != "options"]
    fields = []
    for name, info in model.model_fields.items():
        # A list-valued option (--lora-modules) is a repeated flag: click has no nargs='+'.
        option = typer.Option(*model.cli_declaration(name), help=info.description)
        fields.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY,
            default=info.get_default(call_default_factory=True),
            annotation=Annotated[info.annotation, option]))

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name in model.model_fields}
        try:
            options = model(**values)
        except ValidationError as e:
            raise typer.BadParameter("; ".join(
                f"--{path.replace('_', '-')}: {message}"
                for path, message in problems(e))) from None
        command(options=options, **kwargs)

    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + fields
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


@app.command()
@_needs("emulator")
@_with_emulator_options
def emulator(
    options: EmulatorOptions,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
) -> None:
    """Serve a vLLM-compatible engine emulator (OpenAI API and vLLM's /metrics)."""
    from weighbridge.emulator.server import EmulatorSettings, run_emulator
    from weighbridge.emulator.tokenizer import RULE, ModelTokenizer

    try:
        step_profile = options.step_profile()
        engine = options.engine()
        tokenizer = ModelTokenizer(options.tokenizer) if options.tokenizer else RULE
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    settings = EmulatorSettings(model_name=options.model_name, engine=engine,
                                profile_name=options.profile, seed=options.seed,
                                mean_output_tokens=options.mean_output_tokens,
                                vocab_size=options.vocab_size,
                                num_gpu_blocks_override=options.num_kv_blocks,
                                kv_cache_memory_bytes=options.kv_cache_memory_bytes,
                                enable_lora=options.enable_lora,
                                lora_modules=options.lora_adapters(),
                                stream_interval=options.stream_interval,
                                enable_prompt_tokens_details=(
                                    options.enable_prompt_tokens_details),
                                tokenizer=tokenizer,
                                # As vLLM reads its development switch.
                                dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0")
                                not in ("", "0"),
                                refuse_priority_under_fcfs=options.refuse_priority_under_fcfs)
    typer.echo(f"weighbridge emulator: {options.model_name} on http://{host}:{port} "
               f"(profile {options.profile}, {engine.max_num_seqs} seqs, "
               f"B={engine.max_num_batched_tokens}, {engine.num_kv_blocks}x{engine.block_size} "
               "KV tokens)", err=True)
    run_emulator(settings, step_profile, host, port)


@app.command()
@_needs("sidecar")
def sidecar(
    config: Annotated[str, typer.Option("--config", help="Tenants/tiers/backends YAML file.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve the fair-scheduling sidecar in front of vLLM backends (docs/sidecar.md)."""
    from weighbridge.sidecar.app import run_sidecar

    loaded = _serving_config(config)
    typer.echo(f"weighbridge sidecar on http://{host}:{port}: {len(loaded.tenants)} tenants, "
               f"{len(loaded.backends)} backends, policy {loaded.scheduler.policy}, "
               f"routing {loaded.routing}", err=True)
    run_sidecar(loaded, host, port, config_path=config)


def _serving_config(path: str) -> Config:
    """The config a serving command runs (its log lines on stderr); exit 2 when invalid."""
    import logging

    from weighbridge.sidecar.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return load_config(path)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None


@app.command()
@_needs("sidecar", "epp")
def epp(
    config: Annotated[str, typer.Option("--config", help="Tenants/tiers/backends YAML file.")],
    host: Annotated[str, typer.Option(help="Address the ext_proc gRPC server listens on.")] = (
        "127.0.0.1"),
    port: Annotated[int, typer.Option(help="Port of the ext_proc gRPC server.")] = 9002,
    http_host: Annotated[str, typer.Option(
        help="Address of the HTTP port (/metrics, /healthz, /readyz, /admin).")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option(help="Port of the HTTP port.")] = 9090,
    tenant_from: Annotated[list[str] | None, typer.Option(
        "--tenant-from",
        help="Where a request's tenant is read, in order, the first present deciding: key "
             "(the bearer key), header:NAME or metadata:NAMESPACE/KEY[/KEY...] (set by the "
             "gateway's auth); repeat it. Default: key.")] = None,
    pool_name: Annotated[str | None, typer.Option(
        help="The InferencePool whose ready pods are the backends, watched in the Kubernetes "
             "API (the config's first backend is their template). Default: the config's "
             "backends.")] = None,
    pool_namespace: Annotated[str, typer.Option(
        envvar="POD_NAMESPACE", help="The InferencePool's namespace.")] = "default",
    kubeconfig: Annotated[str | None, typer.Option(
        help="A kubeconfig file for the API server; default: in a cluster its service "
             "account, else $KUBECONFIG or ~/.kube/config.")] = None,
) -> None:
    """Serve the scheduler as an Envoy external processor: the Gateway API Inference
    Extension's endpoint picker (docs/deploy-kubernetes.md)."""
    from weighbridge.sidecar.discovery import PoolRef
    from weighbridge.sidecar.epp import run_epp
    from weighbridge.sidecar.identity import IdentitySource, TrustedSources

    try:
        identity = TrustedSources([IdentitySource.parse(t) for t in tenant_from or ["key"]])
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--tenant-from") from None
    loaded = _serving_config(config)
    pool = None if pool_name is None else PoolRef(pool_namespace, pool_name)
    backends = (f"{len(loaded.backends)} backends" if pool is None else
                f"the ready pods of InferencePool {pool.namespace}/{pool.name}")
    typer.echo(f"weighbridge epp: ext_proc on {host}:{port}, HTTP on http://{http_host}:"
               f"{http_port}: {len(loaded.tenants)} tenants, {backends}, "
               f"policy {loaded.scheduler.policy}", err=True)
    run_epp(loaded, host, port, http_host, http_port, config_path=config, identity=identity,
            pool=pool, kubeconfig=kubeconfig)


@app.command()
@_needs("sidecar")
def reload(
    pid: Annotated[int | None, typer.Option(
        help="Send SIGHUP to this sidecar process (its log says how the reload went).")] = None,
    url: Annotated[str, typer.Option(
        help="Otherwise POST /admin/reload to the sidecar at this URL.")] = (
        "http://127.0.0.1:8000"),
    admin_key: Annotated[str | None, typer.Option(
        envvar="WEIGHBRIDGE_ADMIN_KEY",
        help="An admin API key (or $WEIGHBRIDGE_ADMIN_KEY); default: the config's first "
             "admin key given as plain: or env:.")] = None,
    config: Annotated[Path | None, typer.Option(
        help="The sidecar's config file, to read the admin key from.")] = None,
) -> None:
    """Reload a running sidecar's config file: queues, limits and streams carry over
    (docs/sidecar.md, "Reloading the configuration")."""
    import os
    import signal

    import httpx

    from weighbridge.redaction import redact_url

    if pid is not None:
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as e:
            typer.echo(f"weighbridge reload: pid {pid}: {e.strerror}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"sent SIGHUP to {pid}; the sidecar's log says whether the new "
                   "configuration is in force", err=True)
        return
    key = admin_key or (None if config is None else _admin_key_of(config))
    if key is None:
        raise typer.BadParameter("give --admin-key, $WEIGHBRIDGE_ADMIN_KEY, or --config with "
                                 "an admin key as plain: or env:", param_hint="--admin-key")
    try:
        response = httpx.post(url.rstrip("/") + "/admin/reload",
                              headers={"authorization": f"Bearer {key}"}, timeout=30)
    except httpx.HTTPError as e:
        typer.echo(f"weighbridge reload: {redact_url(url)}: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    if response.status_code != 200:
        message = (answer.get("error") or {}).get("message") or response.text
        typer.echo(f"weighbridge reload: {response.status_code}: {message}", err=True)
        raise typer.Exit(1)
    changes = {k: v for k, v in answer.get("changes", {}).items() if v}
    typer.echo(f"version {answer.get('version')} in force; "
               + (", ".join(f"{k}: {v}" for k, v in changes.items()) or "no change"))


def _admin_key_of(config: Path) -> str | None:
    """The first admin key a config file holds in a form that gives the key back (plain:,
    or env: with the variable set); a sha256 digest does not."""
    import os

    from weighbridge.settings_file import read_yaml
    from weighbridge.sidecar.config import ConfigError

    try:
        data = read_yaml(config, ConfigError)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    keys = data.get("admin_api_keys") if isinstance(data, dict) else None
    for key in keys if isinstance(keys, list) else ():
        scheme, _, rest = str(key).partition(":")
        if scheme == "plain" and rest:
            return rest
        if scheme == "env" and os.environ.get(rest):
            return os.environ[rest]
    return None


@app.command("hash-key")
def hash_key(key: Annotated[str, typer.Argument(help="The raw API key.")]) -> None:
    """Print the sha256:<hex> form of an API key, for api_keys in the config."""
    from weighbridge.keys import hash_api_key

    typer.echo(hash_api_key(key))


@app.command()
@_needs("analysis")
def report(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (run.json + records).")],
    baseline: Annotated[Path | None, typer.Option(
        help="A second run to put side by side, e.g. the FCFS baseline.")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Where report files go (default: RUN_DIR/report).")] = None,
    format: Annotated[str, typer.Option(
        "--format", help="Comma-separated: text, md, html, json.")] = "text,md,html,json",
    window: Annotated[str, typer.Option(help="Window of the time series: 10s, 500ms, 2m.")] = (
        "10s"),
    backlog_fraction: Annotated[float, typer.Option(
        help="Share of a window a tenant must have a request waiting to count as "
             "backlogged.")] = 0.9,
    check: Annotated[list[str] | None, typer.Option(
        help="Gate, e.g. 'fairness.jain_index>=0.95' (repeatable): exit 1 if one "
             "fails.")] = None,
) -> None:
    """Fairness, tier SLOs, isolation, Little's Law and stability of a run (docs/analysis.md)."""
    from rich.console import Console

    from weighbridge.analysis.gate import parse_check
    from weighbridge.analysis.report import ReportRequest, make_report, parse_window

    try:
        request = ReportRequest(
            run_dir=run_dir, baseline_dir=baseline, out_dir=out,
            formats=tuple(f.strip() for f in format.split(",") if f.strip()),
            window_s=parse_window(window), backlog_fraction=backlog_fraction,
            checks=[parse_check(c) for c in check or []])
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        result = make_report(request, Console())
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"weighbridge report: {e}", err=True)
        raise typer.Exit(2) from None
    for path in result.written:
        typer.echo(f"wrote {path}", err=True)
    for verdict in result.verdicts:
        typer.echo(verdict.message, err=not verdict.passed)
    if not result.passed:
        failed = sum(not v.passed for v in result.verdicts)
        typer.echo(f"{failed} of {len(result.verdicts)} check(s) failed", err=True)
        raise typer.Exit(1)


@app.command()
@_needs("analysis")
def capacity(
    requests_per_day: Annotated[float | None, typer.Option(
        help="Requests per day (with --from-run: default the run's arrival rate).")] = None,
    avg_tokens: Annotated[float | None, typer.Option(
        help="Mean prompt + output tokens per request.")] = None,
    tokens_per_second_per_gpu: Annotated[float | None, typer.Option(
        help="Tokens/s one GPU sustains under real load.")] = None,
    peak_to_average: Annotated[float | None, typer.Option(
        help="Peak load over average (default 4, or the run's own with --from-run).")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Key/value heads (GQA).")] = None,
    heads: Annotated[int | None, typer.Option(
        help="Attention heads, assumed to hold KV when --kv-heads is absent.")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Dimension of one head.")] = None,
    context: Annotated[int | None, typer.Option(help="Tokens of KV per sequence.")] = None,
    dtype_bytes: Annotated[float, typer.Option(help="Bytes per KV element.")] = 2.0,
    gpu_memory_gb: Annotated[float, typer.Option(help="GPU memory, GiB.")] = 80.0,
    weights_gb: Annotated[float, typer.Option(help="Model weights per GPU, GiB.")] = 0.0,
    sequence_tokens_per_second: Annotated[float | None, typer.Option(
        help="Decode speed each sequence should get (default 20; --from-run: measured).")
    ] = None,
    from_run: Annotated[Path | None, typer.Option(
        help="Take tokens/s, the token mix and the request rate from a run.")] = None,
    run_gpus: Annotated[int, typer.Option(help="GPUs (engines) that served --from-run.")] = 1,
    format: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """GPUs for a daily token load, on average and at peak, and the KV-cache constraint."""
    import json

    from weighbridge.analysis.capacity import capacity_inputs, plan, plan_lines

    if format not in ("text", "json"):
        raise typer.BadParameter(f"format: {format!r}; choose text or json")
    try:
        inputs = capacity_inputs(
            requests_per_day=requests_per_day, avg_tokens=avg_tokens,
            tokens_per_second_per_gpu=tokens_per_second_per_gpu,
            peak_to_average=peak_to_average, sequence_tokens_per_second=sequence_tokens_per_second,
            layers=layers, kv_heads=kv_heads, heads=heads, head_dim=head_dim, context=context,
            dtype_bytes=dtype_bytes, gpu_memory_gb=gpu_memory_gb, weights_gb=weights_gb,
            from_run=from_run, run_gpus=run_gpus)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    result = plan(inputs)
    if format == "json":
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        for label, value in plan_lines(result):
            typer.echo(f"{label:>28}: {value}")


# ----------------------------------------------------------------------------- demo and up

_PROMETHEUS_MODES = ("auto", "on", "off")


def _prometheus_mode(value: str) -> str:
    if value not in _PROMETHEUS_MODES:
        raise typer.BadParameter(f"{value!r}; choose auto, on or off", param_hint="--prometheus")
    return value


@app.command()
# The demo starts engines, the sidecar and Locust, and reports on both runs.
@_needs("analysis", "emulator", "loadgen", "sidecar")
def demo(
    quick: Annotated[bool, typer.Option(
        "--quick", help="Shorter phases (about 1 minute in all instead of 3).")] = False,
    out: Annotated[Path | None, typer.Option(
        help="Directory for the two run directories, report.html and summary.json "
             "(default: runs/demo-<UTC time>).")] = None,
    stack: Annotated[Path | None, typer.Option(
        help="Stack file (default deploy/stacks/noisy-neighbour.yaml).")] = None,
    prometheus: Annotated[str, typer.Option(
        help="auto: a local Prometheus when installed; on; off.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the load generator.")] = 1,
) -> None:
    """The noisy-neighbour flood through a request-level baseline and through weighbridge,
    side by side (docs/demo.md)."""
    import datetime as dt

    from rich.console import Console

    from weighbridge.app.demo import DemoOptions, run_demo
    from weighbridge.app.loadrun import LoadRunError
    from weighbridge.app.stack import DEFAULT_STACK, StackError
    from weighbridge.launch import LaunchError

    out = out or Path("runs") / f"demo-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}"
    options = DemoOptions(out=out, quick=quick, stack_file=stack or DEFAULT_STACK,
                          # Why the ignore below: _prometheus_mode checked the str is one of
                          # DemoOptions' modes.
                          prometheus=_prometheus_mode(prometheus),  # type: ignore[arg-type]
                          seed=seed)
    try:
        run_demo(options, Console())
    except (StackError, FileExistsError) as e:
        typer.echo(f"weighbridge demo: {e}", err=True)
        raise typer.Exit(2) from None
    except (LaunchError, LoadRunError) as e:
        typer.echo(f"weighbridge demo: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("weighbridge demo: interrupted; every child process stopped", err=True)
        raise typer.Exit(130) from None


@app.command()
# The parts' pure cores run in process; the run directories are written with pandas.
@_needs("analysis")
def simulate(
    scenario: Annotated[str | None, typer.Argument(
        help="Scenario name in scenarios/ or a scenario .py file (default: the stack's).")
    ] = None,
    stack: Annotated[Path | None, typer.Option(
        help="Stack file: engines and the sidecar config (default "
             "deploy/stacks/noisy-neighbour.yaml).")] = None,
    tenants_file: Annotated[Path | None, typer.Option(
        help="Tenants file (default: the stack's for its own scenario, else the "
             "scenario's).")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Replay a trace instead of the scenario: Mooncake JSONL (sent by the tenants "
             "file's tenants), or CSV/Parquet/records naming sidecar tenants (a live run's "
             "requests.parquet too).")] = None,
    trace_tenants: Annotated[str, typer.Option(
        help="A Mooncake trace's tenant rule: hash (of the first block), round_robin, or "
             "column:NAME.")] = "hash",
    trace_speed: Annotated[float, typer.Option(
        help="Replay the trace this many times as fast.")] = 1.0,
    duration: Annotated[float | None, typer.Option(
        help="Seconds of traffic to simulate (default: the scenario's phases).")] = None,
    stretch: Annotated[float, typer.Option(help="Multiply every phase's length.")] = 1.0,
    scale: Annotated[float, typer.Option(help="Multiply every tenant's load.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the clients (as the load generator's).")
                    ] = 0,
    policy: Annotated[list[str] | None, typer.Option(
        help="Scheduling policy: a registered fairness policy (scheduler.policy in "
             "docs/configuration.md: drr, vtc, ...) or baseline (the demo's request-level "
             "baseline); repeat or comma-separate for a side-by-side run (default: the "
             "stack's).")] = None,
    sweep: Annotated[str | None, typer.Option(
        help="KEY=V1,V2,...: vary one stack or sidecar value, e.g. "
             "admission.headroom_slots=0,2,4 or engines.count=2,3,4.")] = None,
    ideal: Annotated[bool, typer.Option(
        "--ideal", help="Add the zero-overhead bound for the same shape.")] = False,
    out: Annotated[Path | None, typer.Option(
        help="Directory for the run directories and summary.json "
             "(default: runs/simulate-<UTC time>).")] = None,
    window: Annotated[str | None, typer.Option(
        help="Window of the figures (default: 2s for runs under 5 minutes, else 10s).")
    ] = None,
) -> None:
    """The whole sidecar against the engine model in virtual time: an hour of traffic in
    seconds, written as live run directories (docs/simulate.md)."""
    import datetime as dt

    from rich.console import Console

    from weighbridge.analysis.report import parse_window
    from weighbridge.app.simulation.batch import SUMMARY_JSON, BatchRequest, run_batch
    from weighbridge.app.simulation.figures import figures_table
    from weighbridge.app.simulation.run import Inputs
    from weighbridge.app.simulation.sweep import parse_sweep
    from weighbridge.app.simulation.trace import TraceError
    from weighbridge.app.stack import DEFAULT_STACK, StackError, load_stack
    from weighbridge.loadgen.scenario import ScenarioError
    from weighbridge.sidecar.config import ConfigError

    console = Console()
    out = out or Path("runs") / f"simulate-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}"
    policies = tuple(p.strip() for value in policy or [] for p in value.split(",") if p.strip())
    try:
        request = BatchRequest(
            inputs=Inputs(stack=load_stack(stack or DEFAULT_STACK), scenario=scenario,
                          tenants_file=tenants_file, trace=trace, duration_s=duration,
                          stretch=stretch, scale=scale, seed=seed,
                          trace_tenants=trace_tenants, trace_speed=trace_speed),
            out=out, policies=policies or (None,),
            sweep=parse_sweep(sweep) if sweep else None, ideal=ideal,
            window_s=parse_window(window) if window else None)
        summary = run_batch(request, lambda m: console.print(m, highlight=False))
    except (StackError, ScenarioError, ConfigError, TraceError, FileExistsError,
            ValueError) as e:
        typer.echo(f"weighbridge simulate: {e}", err=True)
        raise typer.Exit(2) from None
    points = summary["sweep"]["points"] if "sweep" in summary else {"": summary}
    for label, point in points.items():
        console.print(figures_table(f"simulated{': ' + label if label else ''}",
                                    point["runs"]))
        if "ideal" in point:
            console.print_json(data=point["ideal"])
    console.print(f"wrote {out / SUMMARY_JSON}", highlight=False)


@app.command()
@_needs("emulator", "sidecar")
def up(
    stack: Annotated[Path | None, typer.Option(
        help="Stack file (default deploy/stacks/noisy-neighbour.yaml).")] = None,
    prometheus: Annotated[str | None, typer.Option(
        help="auto, on or off (default: the stack file's).")] = None,
    directory: Annotated[Path | None, typer.Option(
        "--dir", help="Logs, the sidecar config and Prometheus's data (default: a temporary "
                      "directory).")] = None,
    replicas: Annotated[int | None, typer.Option(
        min=1, max=16, help="Sidecar processes (default: the stack file's, 1). More than one "
                            "share their state through a redis-server the stack starts, "
                            "behind HAProxy when it is installed.")] = None,
) -> None:
    """Start the local stack (engines, sidecar, Prometheus) and keep it running for
    `locust -f scenarios/`; Ctrl-C stops it all."""
    import shlex
    import tempfile
    import time

    from rich.console import Console

    from weighbridge.app.stack import DEFAULT_STACK, LocalStack, StackError, load_stack
    from weighbridge.launch import LaunchError, sigterm_as_interrupt

    console = Console()
    try:
        spec = load_stack(stack or DEFAULT_STACK)
    except StackError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    if prometheus is not None:
        spec = spec.model_copy(update={"prometheus": _prometheus_mode(prometheus)})
    if replicas is not None:
        spec = spec.model_copy(update={"replicas": replicas})
    where = directory or Path(tempfile.mkdtemp(prefix="weighbridge-up-"))
    try:
        with sigterm_as_interrupt(), LocalStack(
                spec, where, on_event=lambda m: console.print(f"[dim]{m}")) as running:
            urls = running.urls
            console.print(f"[bold]weighbridge stack {spec.name!r} is up[/] (Ctrl-C stops it)")
            console.print(f"  sidecar     {urls.sidecar}  (/metrics, /admin/state)")
            if len(urls.replicas) > 1:
                front = "HAProxy, round robin" if urls.sidecar not in urls.replicas else \
                    "HAProxy not installed: send to each in turn"
                console.print(f"    {len(urls.replicas)} replicas ({front}):")
                for i, url in enumerate(urls.replicas):
                    console.print(f"    sidecar-{i}  {url}")
                console.print(f"  redis       {urls.redis or '(the sidecar config state)'}")
            for i, url in enumerate(urls.engines):
                console.print(f"  engine-{i}    {url}")
            if urls.prometheus:
                console.print(f"  prometheus  {urls.prometheus}")
            else:
                console.print("  prometheus  (not running: install `prometheus` or "
                              "--prometheus on)")
            console.print(f"  logs        {where / 'logs'}")
            for proc in running.replicas:  # edit the file, then reload (docs/sidecar.md)
                config_file = proc.argv[list(proc.argv).index("--config") + 1]
                console.print(f"  reload      edit {config_file}, then weighbridge reload "
                              f"--pid {proc.pid}", highlight=False, soft_wrap=True)
            console.print("Send the scenario (Locust's web UI on http://localhost:8089):")
            console.print("  " + shlex.join(urls.locust_command(spec)), highlight=False,
                          soft_wrap=True)
            while not (dead := running.dead()):
                time.sleep(0.5)
            names = ", ".join(p.name for p in dead)
            console.print(f"[red]{names} exited; stopping the stack (logs in {where / 'logs'})")
            raise typer.Exit(1)
    except LaunchError as e:
        typer.echo(f"weighbridge up: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("stopped")


# ----------------------------------------------------------------------------- dashboards

dashboards_app = typer.Typer(
    help="Grafana dashboards: render them from their Python definitions, upload them.",
    no_args_is_help=True)
app.add_typer(dashboards_app, name="dashboards")


@dashboards_app.command("generate")
@_needs("dashboards")
def dashboards_generate(
    out: Annotated[Path | None, typer.Option(
        help="Directory for the JSON files (default: dashboards/json in the package).")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Write nothing; exit 1 if a file differs from the definitions.")] = False,
) -> None:
    """Write the dashboards' JSON (what Grafana's provisioning and push read)."""
    from weighbridge.dashboards.generate import JSON_DIR, stale_files, write

    directory = out or JSON_DIR
    if check:
        stale = stale_files(directory)
        for path in stale:
            typer.echo(f"out of date: {path}", err=True)
        if stale:
            typer.echo("run: weighbridge dashboards generate", err=True)
            raise typer.Exit(1)
        typer.echo(f"dashboards in {directory} are up to date", err=True)
        return
    for path in write(directory):
        typer.echo(f"wrote {path}", err=True)


@dashboards_app.command("push")
@_needs("dashboards")
def dashboards_push(
    url: Annotated[str, typer.Option(help="Grafana's base URL, e.g. http://localhost:3000.")],
    token: Annotated[str, typer.Option(
        envvar="GRAFANA_TOKEN", help="Service-account token (Editor), or $GRAFANA_TOKEN.")],
    folder: Annotated[str, typer.Option(help="Folder uid (and title) to save into.")] = (
        "weighbridge"),
    source: Annotated[Path | None, typer.Option(
        "--dir", help="Directory of dashboard JSON files (default: dashboards/json).")] = None,
) -> None:
    """Upload the dashboards to Grafana over its HTTP API (overwriting by uid)."""
    from weighbridge.dashboards.generate import JSON_DIR, load
    from weighbridge.dashboards.push import PushError, connect, push

    directory = source or JSON_DIR
    files = sorted(directory.glob("*.json"))
    if not files:
        raise typer.BadParameter(f"no *.json files in {directory}", param_hint="--dir")
    try:
        boards = [load(path) for path in files]
        pushed = push(connect(url, token), boards, folder_uid=folder, folder_title=folder)
    except (ValueError, PushError) as e:
        typer.echo(f"weighbridge dashboards push: {e}", err=True)
        raise typer.Exit(2) from None
    for board in pushed:
        typer.echo(f"{board.title}: {url.rstrip('/')}{board.url}")


def main() -> None:
    app()
