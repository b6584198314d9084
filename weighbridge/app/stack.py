"""A local stack on loopback: N emulated engines, the sidecar in front of them and, when a
``prometheus`` binary is installed, a Prometheus scraping all of them.

A stack is described by a YAML file (``deploy/stacks/*.yaml``, read by ``weighbridge up
--stack FILE``) and validated once, here, with every error naming its field. Starting it is
:class:`LocalStack`, a context manager that owns every child (``weighbridge.launch``: own
process groups, stopped on exit, on error and on Ctrl-C).

Stack file layout::

    engines:
      count: 2
      emulator: {profile: h100-llama3-8b, max_num_seqs: 32, ...}  # `weighbridge emulator` flags
      models: [model-a, model-b]  # engine i serves models[i % len(models)] (its model_name);
                                  # default: every engine serves emulator.model_name
      priority_scheduling: null   # the sidecar sends tier priorities (default: when the
                                  # engines run scheduling_policy: priority)
    sidecar: {...}                # the sidecar config (docs/sidecar.md) without `backends`
    replicas: 1                   # sidecar processes; more than 1: they share their state
                                  # through a redis-server the stack starts, behind HAProxy
    loadgen: {scenario: noisy_neighbour, tenants_file: tenants.yaml, exporter_port: 9646}
    prometheus: auto              # auto (when installed) | on | off
    ports: {sidecar: 8000, engines: 8001, prometheus: 9090}  # 0: any free port
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weighbridge.emulator.options import EmulatorOptions
from weighbridge.launch import (
    LaunchError,
    ServerProcess,
    emulator_process,
    free_port,
    haproxy_process,
    redis_process,
    sidecar_process,
)
from weighbridge.prometheus import ScrapeTarget, binary, prometheus_process, rule_files
from weighbridge.resources import DEPLOY_DIR, SCENARIOS_DIR
from weighbridge.settings_file import SettingsError, problems, read_yaml
from weighbridge.sidecar.config import (
    ConfigError,
    ModelName,
    parse_config,
    request_level_baseline,
)

__all__ = [
    "DEFAULT_STACK",
    "LocalStack",
    "StackError",
    "StackSpec",
    "StackUrls",
    "baseline_stack",
    "load_stack",
    "parse_stack",
    "sidecar_config",
]

DEFAULT_STACK = DEPLOY_DIR / "stacks" / "noisy-neighbour.yaml"

# Prometheus job names as deploy/prometheus/prometheus.yml has them: the dashboards' queries
# and the recording rules select on them.
JOB_SIDECAR = "weighbridge-sidecar"
JOB_ENGINES = "vllm"
JOB_LOADGEN = "weighbridge-loadgen"

PrometheusMode = Literal["auto", "on", "off"]


class StackError(SettingsError, ValueError):
    """Every problem with a stack file, each as ``(dotted.path, message)``."""

    what = "stack"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Engines(_Model):
    count: int = Field(default=2, ge=1, le=64)
    emulator: EmulatorOptions = Field(default_factory=EmulatorOptions)
    # The models the engines serve: engine i serves models[i % len(models)] (the emulator's
    # model_name), so [a, b] on 4 engines is a, b, a, b. None: every engine serves
    # emulator.model_name. Each engine's /v1/models lists its model, from which the
    # sidecar's model-aware routing learns which engines serve a request's `model`.
    models: list[ModelName] | None = Field(default=None, min_length=1)
    # LoRA adapters by base model: every engine serving the model also serves these
    # (vLLM's --lora-modules values, `name=path`), with --enable-lora. The emulator's own
    # lora_modules would put one list on every engine, whatever model it serves.
    adapters: dict[ModelName, list[str]] = Field(default_factory=dict)
    # Whether the sidecar sends each request's tier priority (backends' priority_scheduling);
    # None: when the engines order their queue by priority.
    priority_scheduling: bool | None = None

    def model_for(self, index: int) -> str:
        """The model engine ``index`` serves."""
        if self.models is None:
            return self.emulator.model_name
        return self.models[index % len(self.models)]

    def emulator_for(self, index: int) -> EmulatorOptions:
        """Engine ``index``'s emulator options: the stack's, serving its own model and that
        model's adapters. Validated again, so an adapter vLLM would refuse is an error."""
        model = self.model_for(index)
        adapters = self.adapters.get(model, [])
        if self.models is None and not adapters:
            return self.emulator
        update: dict[str, object] = {"model_name": model}
        if adapters:
            update.update(enable_lora=True,
                          lora_modules=[*self.emulator.lora_modules, *adapters])
        return EmulatorOptions.model_validate({**self.emulator.model_dump(), **update})

    def model_problems(self) -> list[tuple[str, str]]:
        """What is wrong with ``models`` and ``adapters`` given the rest, as (field, message)
        pairs."""
        served = self.models or [self.emulator.model_name]
        out = [(f"engines.adapters.{model}", f"no engine serves {model} (engines.models: "
                                              f"{', '.join(served)})")
               for model in self.adapters if model not in served]
        for index in range(min(self.count, len(served))):
            if self.model_for(index) in self.adapters:
                try:
                    self.emulator_for(index)
                except ValidationError as e:
                    out += [(f"engines.adapters.{self.model_for(index)}", err["msg"])
                            for err in e.errors()]
        if self.models is None:
            return out
        repeated = sorted({m for m in self.models if self.models.count(m) > 1})
        if repeated:
            out.append(("engines.models", f"each model once; repeated: {', '.join(repeated)}"))
        if len(self.models) > self.count:
            out.append(("engines.models", f"{len(self.models)} models but engines.count is "
                                          f"{self.count}: {', '.join(self.models[self.count:])} "
                                          "would be served by no engine"))
        if "model_name" in self.emulator.model_fields_set:
            out.append(("engines.emulator.model_name", "engines.models names the engines' "
                                                       "models; set one or the other"))
        return out

    @property
    def sends_priority(self) -> bool:
        if self.priority_scheduling is not None:
            return self.priority_scheduling
        return self.emulator.scheduling_policy == "priority"


class Loadgen(_Model):
    scenario: str = "noisy_neighbour"
    tenants_file: str | None = None  # relative to the stack file; None: the scenario's own
    exporter_port: int = Field(default=9646, ge=0, lt=65536)  # 0: no exporter


class Ports(_Model):
    """Loopback ports; 0 picks a free one. Engines take consecutive ports from ``engines``."""

    sidecar: int = Field(default=0, ge=0, lt=65536)
    engines: int = Field(default=0, ge=0, lt=65536)
    prometheus: int = Field(default=0, ge=0, lt=65536)


class StackSpec(_Model):
    name: str = "stack"
    engines: Engines = Field(default_factory=Engines)
    sidecar: dict[str, Any] = Field(default_factory=dict)
    # Sidecar processes. Several share their state through a redis-server the stack starts
    # (unless the sidecar section names its own `state`), behind HAProxy when it is
    # installed, else reached at their own ports in turn (docs/sidecar.md, Several replicas).
    replicas: int = Field(default=1, ge=1, le=16)
    loadgen: Loadgen = Field(default_factory=Loadgen)
    prometheus: PrometheusMode = "auto"
    ports: Ports = Field(default_factory=Ports)
    # Where relative paths (loadgen.tenants_file) are resolved; set by load_stack.
    base_dir: str | None = None

    @property
    def tenants_file(self) -> Path | None:
        if self.loadgen.tenants_file is None:
            return None
        path = Path(self.loadgen.tenants_file)
        return path if path.is_absolute() or self.base_dir is None else \
            Path(self.base_dir) / path

    def with_sidecar(self, **changes: Any) -> StackSpec:
        """A copy whose sidecar section has top-level keys replaced (validated again)."""
        return parse_stack({**self.model_dump(), "sidecar": {**self.sidecar, **changes}},
                           source=f"{self.name} (modified)")

    def with_ports(self, ports: Ports) -> StackSpec:
        return self.model_copy(update={"ports": ports})


def baseline_stack(spec: StackSpec) -> StackSpec:
    """The request-level baseline of a stack: the sidecar's (``request_level_baseline``:
    one FIFO, round-robin routing, no tenant-aware admission), and no priorities sent to
    the engines."""
    base = spec.with_sidecar(**request_level_baseline(spec.sidecar))
    engines = base.engines.model_copy(update={"priority_scheduling": False})
    return base.model_copy(update={"engines": engines, "name": f"{spec.name}-baseline"})


def sidecar_config(spec: StackSpec, engine_urls: list[str]) -> dict[str, Any]:
    """The sidecar's configuration mapping: the stack's ``sidecar`` section with one backend
    per engine."""
    # The engines' --stream-interval too: live charging counts a chunk's tokens by it.
    backends = [{"url": url, "name": f"engine-{i}",
                 "priority_scheduling": spec.engines.sends_priority,
                 "stream_interval": spec.engines.emulator.stream_interval}
                for i, url in enumerate(engine_urls)]
    # The stack declares its engines, so it tells the sidecar the one fact of their shape
    # that vLLM's /metrics does not export: the step's token budget (--max-num-batched-tokens,
    # which sizes the derived prefill pacing). Everything else the sidecar learns from the
    # engines. A step_budget_tokens in the stack's own admission section wins.
    admission = dict(spec.sidecar.get("admission") or {})
    admission.setdefault("step_budget_tokens", spec.engines.emulator.max_num_batched_tokens)
    return {**spec.sidecar, "admission": admission, "backends": backends}


def parse_stack(data: Any, *, source: str = "<stack>", base_dir: Path | None = None) -> StackSpec:
    """Validate a parsed mapping: the stack's own fields, the emulator's start-up checks and
    the sidecar section against the sidecar's schema."""
    if not isinstance(data, Mapping):
        raise StackError(source, [("(top level)", "must be a mapping of settings")])
    data = dict(data)
    if base_dir is not None:
        data.setdefault("base_dir", str(base_dir))
    try:
        spec = StackSpec.model_validate(data)
    except ValidationError as exc:
        raise StackError(source, problems(exc)) from None
    errors: list[tuple[str, str]] = []
    try:
        spec.engines.emulator.check()
    except ValueError as exc:
        errors.append(("engines.emulator", str(exc)))
    errors += spec.engines.model_problems()
    if "backends" in spec.sidecar:
        errors.append(("sidecar.backends", "set by the stack (one backend per engine); "
                                           "remove it"))
    else:
        placeholder = [f"http://127.0.0.1:{9 + i}" for i in range(spec.engines.count)]
        try:
            parse_config(sidecar_config(spec, placeholder), environ=os.environ)
        except ConfigError as exc:
            errors += [(f"sidecar.{path}", message) for path, message in exc.errors]
    tenants = spec.tenants_file
    if tenants is not None and not tenants.is_file():
        errors.append(("loadgen.tenants_file", f"no such file: {tenants}"))
    if errors:
        raise StackError(source, errors)
    return spec


def load_stack(path: str | os.PathLike[str]) -> StackSpec:
    """Load and validate a stack file; raises StackError naming the file."""
    data = read_yaml(path, StackError)
    return parse_stack(data, source=os.fspath(path), base_dir=Path(path).resolve().parent)


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class StackUrls:
    sidecar: str
    engines: tuple[str, ...]
    prometheus: str | None
    loadgen_exporter: str | None  # where Prometheus looks for the load generator
    replicas: tuple[str, ...] = ()  # every sidecar process (``sidecar`` is their front)
    redis: str | None = None  # the state replicas share, when the stack started it

    def locust_command(self, spec: StackSpec, *, headless: bool = False) -> list[str]:
        """The command that sends the stack's scenario through its sidecar."""
        argv = ["locust", "-f", _display_path(SCENARIOS_DIR) + "/", "--scenario",
                spec.loadgen.scenario, "--host", self.sidecar]
        if spec.tenants_file is not None:
            argv += ["--tenants-file", _display_path(spec.tenants_file)]
        if spec.loadgen.exporter_port != 9646:
            argv += ["--exporter-port", str(spec.loadgen.exporter_port)]
        if headless:
            argv.append("--headless")
        return argv


def _display_path(path: Path) -> str:
    """Relative to the working directory when under it (a checkout), else absolute (an
    installed package's files)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if relative.startswith("..") else relative


def _haproxy_available() -> bool:
    return shutil.which("haproxy") is not None


def _prometheus_available() -> bool:
    try:
        binary("prometheus")
    except LaunchError:
        return False
    return True


@dataclass(eq=False)
class LocalStack:
    """The stack's processes; ``with LocalStack(spec, directory) as stack:`` starts them all
    (engines in parallel) and stops them all at the end of the block, whatever happens."""

    spec: StackSpec
    directory: Path  # logs, the generated sidecar config and Prometheus's data
    host: str = "127.0.0.1"
    on_event: Callable[[str], None] | None = None  # progress messages ("engine-0 up")
    engines: list[ServerProcess] = field(default_factory=list, init=False)
    sidecar: ServerProcess | None = field(default=None, init=False)  # the first replica
    replicas: list[ServerProcess] = field(default_factory=list, init=False)
    redis: ServerProcess | None = field(default=None, init=False)
    front: ServerProcess | None = field(default=None, init=False)  # HAProxy over replicas
    prometheus: ServerProcess | None = field(default=None, init=False)

    def _note(self, message: str) -> None:
        if self.on_event is not None:
            self.on_event(message)

    def _port(self, wanted: int) -> int:
        return wanted or free_port(self.host)

    @property
    def wants_prometheus(self) -> bool:
        mode = self.spec.prometheus
        return mode == "on" or (mode == "auto" and _prometheus_available())

    def start(self) -> LocalStack:
        logs = self.directory / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        spec, ports = self.spec, self.spec.ports
        try:
            for i in range(spec.engines.count):
                port = ports.engines + i if ports.engines else free_port(self.host)
                proc = emulator_process(name=f"engine-{i}", host=self.host, port=port,
                                        **spec.engines.emulator_for(i).flags(seed_offset=i))
                proc.log_path = logs / f"engine-{i}.log"
                self.engines.append(proc)
            self._note(f"starting {len(self.engines)} engines")
            with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
                for future in [pool.submit(p.start) for p in self.engines]:
                    future.result()
            config = sidecar_config(spec, [p.url for p in self.engines])
            if spec.replicas == 1:
                self._note("starting the sidecar")
                self.sidecar = sidecar_process(config, name="sidecar", host=self.host,
                                               port=self._port(ports.sidecar),
                                               config_dir=self.directory)
                self.sidecar.log_path = logs / "sidecar.log"
                self.replicas = [self.sidecar]
                self.sidecar.start()
            else:
                self._start_replicas(config, logs)
            if self.wants_prometheus:
                self._note("starting Prometheus")
                self.prometheus = self._prometheus_process()
                self.prometheus.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_replicas(self, config: dict[str, Any], logs: Path) -> None:
        """Several sidecars sharing their state through Redis, behind HAProxy if installed."""
        spec = self.spec
        if "state" not in spec.sidecar:
            self._note("starting Redis")
            self.redis = redis_process(self.directory / "redis", host=self.host)
            self.redis.log_path = logs / "redis.log"
            self.redis.start()
            config = {**config, "state": {"backend": "redis", "url": self.redis.url}}
        self._note(f"starting {spec.replicas} sidecar replicas")
        front_port = self._port(spec.ports.sidecar) if _haproxy_available() else 0
        for i in range(spec.replicas):
            # Without HAProxy, the first replica takes the stack's sidecar port.
            port = free_port(self.host) if front_port or i else self._port(
                spec.ports.sidecar)
            proc = sidecar_process(config, name=f"sidecar-{i}", host=self.host, port=port,
                                   config_dir=self.directory)
            proc.log_path = logs / f"sidecar-{i}.log"
            self.replicas.append(proc)
        with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
            for future in [pool.submit(p.start) for p in self.replicas]:
                future.result()
        self.sidecar = self.replicas[0]
        if front_port:
            self._note("starting HAProxy")
            self.front = haproxy_process([p.url for p in self.replicas],
                                         self.directory / "haproxy", host=self.host,
                                         port=front_port)
            self.front.log_path = logs / "haproxy.log"
            self.front.start()

    def _prometheus_process(self) -> ServerProcess:
        assert self.sidecar is not None
        targets = [ScrapeTarget(JOB_SIDECAR, p.url) for p in self.replicas]
        targets += [ScrapeTarget(JOB_ENGINES, p.url) for p in self.engines]
        exporter = self.loadgen_exporter_url
        if exporter is not None:
            targets.append(ScrapeTarget(JOB_LOADGEN, exporter))
        return prometheus_process(targets, rule_files(), interval_s=1.0,
                                  directory=self.directory / "prometheus",
                                  port=self._port(self.spec.ports.prometheus), host=self.host)

    @property
    def loadgen_exporter_url(self) -> str | None:
        port = self.spec.loadgen.exporter_port
        return f"http://{self.host}:{port}" if port else None

    @property
    def urls(self) -> StackUrls:
        if self.sidecar is None:
            raise LaunchError("the stack is not running")
        return StackUrls(
            sidecar=(self.front or self.sidecar).url,
            engines=tuple(p.url for p in self.engines),
            prometheus=self.prometheus.url if self.prometheus else None,
            loadgen_exporter=self.loadgen_exporter_url if self.prometheus else None,
            replicas=tuple(p.url for p in self.replicas),
            redis=self.redis.url if self.redis else None)

    def processes(self) -> list[ServerProcess]:
        procs = [*self.engines, self.redis, *self.replicas, self.front, self.prometheus]
        return [p for p in procs if p is not None]

    def dead(self) -> list[ServerProcess]:
        """Children that were started and have exited since (a crash while running)."""
        return [p for p in self.processes() if p.pid is not None and not p.is_running()]

    def stop(self) -> None:
        # Every process is asked to stop at once (SIGTERM), front to back: the sidecar's
        # clients first, then what it proxied to; then each is waited for (and killed after
        # its stop timeout). One by one, a sidecar draining its streams and two engines
        # draining theirs took 30 s or more to stop on a loaded machine, and a Ctrl-C'd demo
        # looked hung.
        procs = [p for p in [self.prometheus, self.front, *self.replicas,
                             *reversed(self.engines), self.redis] if p is not None]
        for proc in procs:
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
